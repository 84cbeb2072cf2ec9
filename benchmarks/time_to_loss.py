"""Time to loss, one change at a time: from nanoGPT's CPU recipe to presets/cpu_speedrun.yaml.

    python benchmarks/time_to_loss.py                  # every row, seed 1337, 2 threads
    python benchmarks/time_to_loss.py --seeds 1337 42
    python benchmarks/time_to_loss.py --first-row 5    # the preset, then each model option alone on it

Each row trains nanoGPT's CPU model (4 x 4 x 128, block 64, no biases, benchmarks/cpu_shakespeare.py's
NANOGPT_CPU) with the changes of the rows above it plus its own, for a step count that keeps the
wall time near half of nanoGPT's 2000 steps, one run after the other (main.py, one process, 2
threads, evaluation only at the end, start-up included in the wall time). The val loss is
benchmarks/vs_nanogpt.py's: the final weights on the whole validation split of nanoGPT's, in
non-overlapping 64-token windows. The target is nanoGPT's own val loss at its step 2000 measured
the same way (`--target`, default the figure in docs/performance.md); vs_nanogpt.py --preset
measures it side by side. Then each of the modded-nanogpt speedruns' model options (OPTIONS) alone
on top of the last row, the preset.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)
from cpu_shakespeare import NANOGPT_CPU
from vs_nanogpt import env, our_val_loss

from testing.local import CORPUS, REPO

# (name, steps, overrides added by this row); each row keeps the rows above it
ROWS = [
    ("nanoGPT's recipe (AdamW lr 1e-3, batch 12)", 1000, []),
    ("peak LR 6e-3, warmup 50", 1200, ["optimizer.lr=6e-3", "optimizer.warmup_steps=50"]),
    ("batch 16", 900, ["trainer.batch_size=16"]),
    ("Muon for the blocks' matrices", 400, ["optimizer.name=muon"]),
    ("batch 32, LR 1e-2, warmup 25", 250, ["trainer.batch_size=32", "optimizer.lr=1e-2", "optimizer.warmup_steps=25"]),
    ("LR 2e-2 (presets/cpu_speedrun.yaml)", 250, ["optimizer.lr=2e-2"]),
]
# the modded-nanogpt speedruns' model options, each alone on top of the last row (the preset)
OPTIONS = [
    ("+ ReLU^2 MLP", ["model.activation=relu2"]),
    ("+ QK-norm", ["model.qk_norm=true"]),
    ("+ zero-initialised output projections", ["model.zero_init_proj=true"]),
    ("+ untied LM head", ["model.tie_weights=false"]),
]


def train(run: Path, steps: int, seed: int, overrides: list[str], threads: int) -> tuple[float, float]:
    """(wall seconds, val loss) of one main.py run."""
    args = [f"data.path={CORPUS}", *NANOGPT_CPU, *overrides, f"trainer.max_steps={steps}",
            f"optimizer.lr_decay_steps={steps}", f"trainer.eval_every={steps}", "trainer.save_every=0",
            "trainer.sample_tokens=0", "trainer.log_every=50", "trainer.hang_timeout_s=0", f"trainer.seed={seed}",
            f"trainer.run_dir={run}"]
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "main.py", *args], cwd=REPO, env=env(threads), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"main.py failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    text = CORPUS.read_text(encoding="utf-8")
    return wall, our_val_loss(run / "model.pt", text[int(len(text) * 0.9):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", type=float, default=1.8982, help="nanoGPT's val loss at its step 2000")
    ap.add_argument("--first-row", type=int, default=0,
                    help="train from this row on (0-based; the rows above still add their changes)")
    args = ap.parse_args()
    print(f"| change (cumulative) | steps | wall s | val loss | <= {args.target} |")
    print("|---|---|---|---|---|")
    overrides: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        for i, (name, steps, extra) in enumerate(ROWS):
            overrides += extra
            if i < args.first_row:
                continue
            row(Path(d) / f"row{i}", name, steps, overrides, args)
        steps = ROWS[-1][1]
        for i, (name, extra) in enumerate(OPTIONS):
            row(Path(d) / f"option{i}", name, steps, overrides + extra, args)


def row(run: Path, name: str, steps: int, overrides: list[str], args) -> None:
    for seed in args.seeds:
        wall, val = train(run.with_name(f"{run.name}-{seed}"), steps, seed, overrides, args.threads)
        label = name if len(args.seeds) == 1 else f"{name}, seed {seed}"
        print(f"| {label} | {steps} | {wall:.1f} | {val:.4f} | {'yes' if val <= args.target else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
