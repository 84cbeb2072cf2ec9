"""What presets/cpu_fast.yaml's settings each buy, in one process: the precision, what is compiled and
the attention kernel, as whole Trainer steps timed in interleaved rounds.

    python benchmarks/fast_preset_variants.py              # 2 threads, 6 rounds of 15 steps
    python benchmarks/fast_preset_variants.py --rounds 10

Two measurements on nanoGPT's CPU model (4 x 4 x 128, block 64, batch 12; the preset's recipe):

1. One layer's attention, forward + backward at (12, 4 heads, 64 tokens, 32), timed alone (best
   of 5 x 100): torch's fused kernel (`trainer.attention=sdpa`, flash on a CPU) and the plain ops
   of model.py's matmul_attention (`trainer.attention=matmul`), each in fp32 and bf16.
2. Whole optimizer steps (`Trainer.train_step`: forward, backward, clip, AdamW) of each variant
   below, built as the launch builds them (launch/build.py), every variant once per round and
   the median over rounds, so machine noise hits all of them alike. The first variant is
   nanoGPT's own setting (fp32, eager, the fused kernel), the last the preset's choice on a CPU
   with bf16 instructions.

The CPU's model and the flags that decide its fastest precision are printed with the figures. The
ratio the preset's target is stated in (tokens/s against nanoGPT's own train.py) is measured side
by side by benchmarks/vs_nanogpt.py; this says which setting buys what.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)
import torch

from checks import load_config
from launch.build import build_trainer
from model import causal_attention, matmul_attention
from observe.perf import cpu_line
from parallel.env import init_distributed
from testing.local import CORPUS, REPO

PRESET = REPO / "presets" / "cpu_fast.yaml"
B, M = "trainer.compile_scope=blocks", "trainer.compile_scope=model"
VARIANTS = {  # name: overrides of the preset
    "fp32, eager, sdpa (nanoGPT's)": ["trainer.precision=fp32", "trainer.compile=false", B, "trainer.attention=sdpa"],
    "fp32, compiled blocks, sdpa": ["trainer.precision=fp32", B, "trainer.attention=sdpa"],
    "fp32, compiled blocks, matmul": ["trainer.precision=fp32", B],
    "fp32, compiled model, matmul": ["trainer.precision=fp32", M],
    "bf16, eager, sdpa": ["trainer.precision=bf16", "trainer.compile=false", B, "trainer.attention=sdpa"],
    "bf16, compiled blocks, sdpa": ["trainer.precision=bf16", B, "trainer.attention=sdpa"],
    "bf16, eager, matmul": ["trainer.precision=bf16", "trainer.compile=false", B],
    "bf16, compiled blocks, matmul": ["trainer.precision=bf16", B],
    "bf16, compiled model, matmul (the preset)": ["trainer.precision=bf16", M],
}


def attention_ms(kernel, dtype: torch.dtype) -> float:
    """Best milliseconds of one layer's attention forward + backward at the preset's shape."""
    q, k, v = (torch.randn(12, 4, 64, 32, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(12, 4, 64, 32, dtype=dtype)
    for _ in range(10):
        kernel(q, k, v).backward(grad)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(100):
            kernel(q, k, v).backward(grad)
        best = min(best, (time.perf_counter() - t) / 100)
    return 1e3 * best


def time_steps(rounds: int, steps: int, scratch: Path) -> dict[str, list[float]]:
    trainers = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        run = scratch / f"v{i}"
        cfg = load_config(str(PRESET), [f"data.path={CORPUS}", f"trainer.run_dir={run}", "wandb.enabled=false",
                                        *overrides])
        trainers[name] = build_trainer(cfg, init_distributed(cfg), run)
        print(f"  warming up {name}", flush=True)
        for _ in range(10):  # compiles included
            trainers[name].train_step()
    times = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            per_step = []
            for _ in range(steps):
                t = time.perf_counter()
                trainer.train_step()
                per_step.append(time.perf_counter() - t)
            times[name].append(1e3 * statistics.median(per_step))
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2, nanoGPT's CPU runs here)")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default: 6)")
    ap.add_argument("--steps", type=int, default=15, help="steps per variant per round (default: 15)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{cpu_line()} | threads {torch.get_num_threads()} | torch {torch.__version__}", flush=True)
    print("one layer's attention, forward + backward, (12, 4, 64, 32):")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"  {str(dtype).removeprefix('torch.'):9s} sdpa {attention_ms(causal_attention, dtype):6.3f} ms | "
              f"matmul {attention_ms(matmul_attention, dtype):6.3f} ms", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="fast-preset-"))
    try:
        times = time_steps(args.rounds, args.steps, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = statistics.median(next(iter(times.values())))
    print(f"{'variant':44s} {'median ms/step':>15s} {'spread':>14s} {'speed-up':>9s}")
    for name, v in times.items():
        med = statistics.median(v)
        print(f"{name:44s} {med:15.2f} {min(v):6.2f}-{max(v):<7.2f} {base / med:8.2f}x")
    print(f"{cpu_line()} | threads {torch.get_num_threads()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
