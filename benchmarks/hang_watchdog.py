"""What the hang watchdog costs an ordinary step: the same run with trainer.hang_timeout_s=0 (no
watchdog thread, no flight recorder) and =300 (the default), interleaved, median step time of each.

    python benchmarks/hang_watchdog.py                 # ddp over 2 local processes, 3 pairs
    python benchmarks/hang_watchdog.py --pairs 5 parallel.strategy=fsdp

First it times the flight recorder alone, where whole-run step times are too noisy to show it: one
process, a gloo group of one, 25,000 one-element all_reduces with and without TORCH_FR_BUFFER_SIZE
(each in a fresh interpreter, since the recorder is set up with the first process group).

The cost on a step is one heartbeat (an assignment) plus the flight recorder's entry for each
collective (its sequence number, sizes and state). Runs are interleaved (off, on, off, on, ...) so
that a machine whose speed drifts shifts both alike; each run's figure is the median of its
metrics rows' step_time_ms after the first (which includes warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)

from testing.local import CORPUS, torchrun

# nanoGPT's Shakespeare-char CPU model, a step of ~0.1-0.3 s on one thread per rank.
BASE = [f"data.path={CORPUS}", "model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=64",
        "trainer.batch_size=12", "trainer.max_steps=60", "trainer.log_every=5", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.sample_tokens=0", "wandb.enabled=false", "parallel.strategy=ddp"]


PER_COLLECTIVE = """
import statistics, time, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
x = torch.ones(1)
for _ in range(500):
    dist.all_reduce(x)
runs = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(5000):
        dist.all_reduce(x)
    runs.append((time.perf_counter() - t) / 5000 * 1e6)
print(statistics.median(runs))
dist.destroy_process_group()
"""


def collective_us(recorder: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
    env.update(OMP_NUM_THREADS="1", **({"TORCH_FR_BUFFER_SIZE": "2000"} if recorder else {}))
    out = subprocess.run([sys.executable, "-c", PER_COLLECTIVE], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def median_step_ms(overrides: list[str], nproc: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        r = torchrun(nproc, ["main.py", *overrides, f"trainer.run_dir={run}"], timeout=600)
        if r.returncode != 0:
            raise SystemExit(r.stdout[-2000:] + r.stderr[-2000:])
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return statistics.median(row["step_time_ms"] for row in rows[1:] if "step_time_ms" in row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    alone = {"off": [], "on": []}
    for _ in range(3):
        for name in ("off", "on"):
            alone[name].append(collective_us(name == "on"))
    off_us, on_us = statistics.median(alone["off"]), statistics.median(alone["on"])
    print(f"one all_reduce (gloo, world 1): {off_us:.1f} us without the flight recorder, {on_us:.1f} us with it "
          f"({on_us - off_us:+.1f} us per collective, median of 3 interleaved pairs)")
    figures: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.pairs):
        for name, timeout in (("off", 0), ("on", 300)):
            figures[name].append(median_step_ms(BASE + args.overrides + [f"trainer.hang_timeout_s={timeout}"],
                                                args.nproc))
    off, on = statistics.median(figures["off"]), statistics.median(figures["on"])
    for name, values in figures.items():
        print(f"hang_timeout_s {'300' if name == 'on' else '0':>3}: median step {statistics.median(values):7.1f} ms "
              f"(runs: {', '.join(f'{v:.1f}' for v in values)})")
    print(f"watchdog cost: {100 * (on - off) / off:+.2f}% of a step (median of {args.pairs} interleaved pairs)")


if __name__ == "__main__":
    main()
