"""CPU speed benchmark: nanoGPT's CPU Shakespeare-char run through this project's Trainer.

Trains nanoGPT's documented CPU configuration and measures MFU against this machine's own fp32
matmul peak.

nanoGPT's README runs, on a CPU:
    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
i.e. 4 layers x 4 heads x 128, block 64, batch 12, AdamW lr 1e-3 -> 1e-4 (cosine over 2000 steps,
warmup 100), betas (0.9, 0.99), weight decay 0.1, clip 1.0, no dropout, no biases (nanoGPT's
`bias = False`), and reports val loss ~1.88 at step 2000. The same settings here are the
overrides in NANOGPT_CPU below; the rest is gpt2_train_cfg.yaml.

Printed: val loss at step 2000, median ms per optimizer step (eval, logging and snapshots are
not in the step), tokens/s at that median, and MFU = FLOPs/token x tokens/s / peak, where
FLOPs/token = 6N + 12LCT (GPT.flops_per_token) and the peak is the best fp32 1024^3 matmul on the
same threads, measured before and after training (the higher one counts, so neighbours' load
cannot inflate the MFU). `--profile K` prints a torch.profiler table of K steps instead.

    python benchmarks/cpu_shakespeare.py                 # all cores, torch.compile'd model
    python benchmarks/cpu_shakespeare.py --no-compile    # eager
    python benchmarks/cpu_shakespeare.py --threads 1     # one core
    python benchmarks/cpu_shakespeare.py --profile 40    # where a step's time goes

The benchmark turns trainer.compile on (the project's default is off): on this 2-core machine the
compiled step is ~10% faster, and the median step time excludes the one-off compile (~60 s cold,
~5 s from inductor's cache; printed as "first step").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from _repo import REPO

from checks import load_config
from config import UsageError
from launch.build import build_trainer
from launch.errors import reject_dashed_overrides
from observe.perf import measure_cpu_matmul_peak
from parallel.env import init_distributed
from testing.local import CORPUS

NANOGPT_CPU = [
    "model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=64",
    "model.dropout=0.0", "model.bias=false", "model.tie_weights=true",
    "trainer.batch_size=12", "trainer.micro_batch_size=0", "trainer.max_epochs=0",
    "trainer.grad_clip=1.0", "trainer.precision=fp32",
    "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "optimizer.warmup_steps=100",
    "optimizer.lr_decay_steps=2000", "optimizer.weight_decay=0.1",
    "optimizer.beta1=0.9", "optimizer.beta2=0.99",
    "trainer.eval_every=250", "trainer.eval_batches=20",  # nanoGPT: eval_interval 250, eval_iters 20
    "parallel.strategy=none", "wandb.enabled=false", "trainer.sample_tokens=0",
    "trainer.save_every=0", "trainer.log_every=50", "trainer.resume=never",
]
TARGET_VAL_LOSS = 1.89
TARGET_MFU = 0.40


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (nanoGPT: 2000)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch threads (default: all %(default)s cores)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="trainer.compile: torch.compile the model (default: on; --no-compile for eager)")
    ap.add_argument("--data", default=str(CORPUS) if CORPUS.is_file() else "",
                    help="corpus path (default: ../shared/data/tinyshakespeare.txt, else the URL)")
    ap.add_argument("--run-dir", default=str(REPO / "runs" / "bench_cpu_shakespeare"),
                    help="scratch run folder (deleted first)")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="profile K steps (after 10 warm-up steps) and print the table; no full run")
    ap.add_argument("--json", default="", help="also write the results to this JSON file")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value overrides")
    try:
        reject_dashed_overrides(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        ap.exit(2, f"error: {e}\n")
    return ap.parse_args(argv)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (1 min) {five:.2f} (5 min)"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = list(NANOGPT_CPU) + [f"trainer.max_steps={args.steps}",
                                     f"trainer.compile={str(args.compile).lower()}",
                                     f"trainer.run_dir={args.run_dir}"]
    if args.data:
        overrides.append(f"data.path={args.data}")
    overrides += args.overrides
    print(f"threads {torch.get_num_threads()} | torch {torch.__version__} | {load()}", flush=True)
    peak_before = measure_cpu_matmul_peak(n=1024, repeats=20, min_seconds=2.0, refresh=True)
    print(f"fp32 matmul peak (best 1024^3 matmul, {args.threads} threads): {peak_before / 1e9:.1f} GFLOP/s",
          flush=True)

    cfg = load_config(None, overrides)
    cfg.trainer.peak_flops = peak_before  # the Trainer's own MFU column uses the same peak
    run_dir = Path(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    trainer = build_trainer(cfg, init_distributed(cfg), run_dir)
    tokens_per_step = cfg.trainer.batch_size * cfg.model.block_size
    print(f"model: {trainer.model_cost.num_params:,} parameters, {trainer.model_cost.flops_per_token / 1e6:.3f} "
          f"MFLOP/token, {tokens_per_step} tokens/step, compile={cfg.trainer.compile}", flush=True)

    if args.profile:
        return profile(trainer, args.profile)

    step_times: list[float] = []
    untimed_step = trainer.train_step

    def timed_step():
        t0 = time.perf_counter()
        out = untimed_step()
        step_times.append(time.perf_counter() - t0)
        return out

    trainer.train_step = timed_step
    wall0 = time.perf_counter()
    summary = trainer.train()
    wall = time.perf_counter() - wall0
    peak_after = measure_cpu_matmul_peak(n=1024, repeats=20, min_seconds=2.0, refresh=True)
    peak = max(peak_before, peak_after)

    steady = step_times[10:] if len(step_times) > 20 else step_times  # first steps: warm-up/compile
    median = statistics.median(steady)
    tokens_per_sec = tokens_per_step / median
    mfu = trainer.model_cost.flops_per_token * tokens_per_sec / peak
    result = {
        "steps": trainer.step, "val_loss": summary.val_loss, "median_step_ms": 1000 * median,
        "p10_step_ms": 1000 * statistics.quantiles(steady, n=10)[0],
        "p90_step_ms": 1000 * statistics.quantiles(steady, n=10)[-1],
        "first_step_s": step_times[0], "tokens_per_sec": tokens_per_sec,
        "mean_tokens_per_sec": tokens_per_step * len(steady) / sum(steady),
        "wall_s": wall, "peak_gflops": peak / 1e9, "peak_before_gflops": peak_before / 1e9,
        "peak_after_gflops": peak_after / 1e9, "mfu": mfu, "threads": args.threads,
        "compile": cfg.trainer.compile, "flops_per_token": trainer.model_cost.flops_per_token,
        "loadavg_after": os.getloadavg()[0],
    }
    print(f"\n=== nanoGPT CPU Shakespeare-char through minGPT-parallel ({args.threads} threads, "
          f"compile={cfg.trainer.compile}) ===")
    print(f"val loss at step {trainer.step}: {summary.val_loss:.4f}   (target <= {TARGET_VAL_LOSS})")
    print(f"median step: {1000 * median:.2f} ms   (p10 {result['p10_step_ms']:.2f}, p90 "
          f"{result['p90_step_ms']:.2f}; first step {step_times[0]:.2f} s)")
    print(f"tokens/s: {tokens_per_sec:,.0f} at the median step ({result['mean_tokens_per_sec']:,.0f} mean)")
    print(f"MFU: {100 * mfu:.1f}% of the measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s "
          f"(before {peak_before / 1e9:.1f}, after {peak_after / 1e9:.1f})   (target >= "
          f"{100 * TARGET_MFU:.0f}%)")
    print(f"wall: {wall:.1f} s for {trainer.step} steps incl. eval | {load()}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def profile(trainer, steps: int) -> int:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    for _ in range(10):  # warm-up (and compilation)
        trainer.train_step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        elapsed = time.perf_counter() - t0
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows)
    print(f"{'op':<60} {'self ms/step':>12} {'share':>6} {'calls/step':>10}")
    for e in rows[:30]:
        print(f"{e.key[:60]:<60} {e.self_cpu_time_total / 1000 / steps:12.3f} "
              f"{100 * e.self_cpu_time_total / total:5.1f}% {e.count / steps:10.1f}")
    print(f"{1000 * elapsed / steps:.2f} ms/step under the profiler | {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
