"""Two cores, two ways: one process with 2 threads against ddp over 2 processes with 1 thread each.

    python benchmarks/cpu_data_parallel.py              # nanoGPT's CPU config, 500 steps each
    python benchmarks/cpu_data_parallel.py --steps 2000

Both train nanoGPT's CPU config (benchmarks/cpu_shakespeare.py's NANOGPT_CPU: global batch 12,
so 6 sequences per rank under ddp) through main.py, one after the other, the multi-process one
under the machine-wide multi-process lock (testing/local.py). Printed: median step time (metrics'
step_time_ms), tokens/s at that median, the val loss main.py reports at the end, and the ratio.
The runs are the same training up to the order of float additions (ddp averages two half-batch
gradients), so the losses agree closely and the ratio is the speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)
from cpu_shakespeare import NANOGPT_CPU

from testing.local import CORPUS, REPO, child_env, torchrun

TOKENS = 12 * 64  # nanoGPT's batch x block


def overrides(run: Path, steps: int) -> list[str]:
    return [f"data.path={CORPUS}", *NANOGPT_CPU, f"trainer.max_steps={steps}", f"optimizer.lr_decay_steps={steps}",
            f"trainer.eval_every={steps}", "trainer.save_every=0", "trainer.sample_tokens=0", "trainer.log_every=25",
            "trainer.hang_timeout_s=0", f"trainer.run_dir={run}"]


def summary(run: Path) -> tuple[float, float]:
    """(median step ms, final val loss) from metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_ms"] for r in rows[1:]), rows[-1]["val_loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        one, two = Path(d) / "one", Path(d) / "ddp2"
        r = subprocess.run([sys.executable, "main.py", *overrides(one, args.steps), "parallel.strategy=none"],
                           cwd=REPO, env=child_env(OMP_NUM_THREADS="2"), capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"one process failed:\n{r.stderr[-2000:]}")
        r = torchrun(2, ["main.py", *overrides(two, args.steps), "parallel.strategy=ddp"], timeout=3600)
        if r.returncode:
            raise SystemExit(f"ddp failed:\n{r.stderr[-2000:]}")
        (ms1, val1), (ms2, val2) = summary(one), summary(two)
    print(f"one process, 2 threads      : median step {ms1:6.1f} ms = {TOKENS / ms1 * 1000:8,.0f} tokens/s | "
          f"val loss {val1:.4f}")
    print(f"ddp, 2 processes x 1 thread : median step {ms2:6.1f} ms = {TOKENS / ms2 * 1000:8,.0f} tokens/s | "
          f"val loss {val2:.4f}")
    print(f"ratio (ddp / one process): {ms1 / ms2:.2f}x tokens/s")


if __name__ == "__main__":
    main()
