"""What micro-batches in flight cost a pipeline stage's compute on this CPU, one thread, one process:
a stack of GPT blocks run four micro-batches at a time (all forwards, then all backwards, as a
pipeline stage holds them) against one at a time, and against one block alone as the calibration
times it (tools/calibrate.py measure_block).

    flock /tmp/mingpt-mp.lock python benchmarks/inflight_cost.py

Per (width, positions, sequences of a micro-batch, blocks in the stack): the median seconds per
block per micro-batch of each way, the cases taking turns over ROUNDS rounds (so a drift of this
shared machine's speed reaches all of them alike). The planner prices every block as the
calibration's hot one (planner/compute.py), whatever the schedule holds in flight; docs/planner.md
("Zero-bubble played with each stage's own costs") has the figures and what they explain.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import _repo  # noqa: F401  (the repository on sys.path)
import torch

from model import Block, GPTConfig
from observe.host_memory import return_large_frees, reuse_step_memory
from observe.perf import cpu_line

# width, positions, sequences per micro-batch, blocks: the grid's shapes B (8 x 64) and F (8 x 256)
# cut into the stages of pp2 (4 blocks) and of ZB-V at pp2 (2 blocks), and one wider stage
CASES = [(64, 64, 4, 4), (64, 64, 4, 2), (256, 32, 4, 4), (256, 32, 4, 2), (512, 64, 2, 2)]
MICROBATCHES = 4


def per_block_seconds(width: int, positions: int, sequences: int, blocks: int, rounds: int) -> dict[str, float]:
    """Median seconds per block per micro-batch: `alone` one block on one input, again and again;
    `one at a time` the stack's forward then backward per micro-batch; `in flight` every
    micro-batch's forward, then every backward."""
    cfg = GPTConfig(block_size=positions, n_embd=width, n_head=4, dropout=0.0)
    one, stack = Block(cfg), torch.nn.Sequential(*[Block(cfg) for _ in range(blocks)])
    x = torch.randn(sequences, positions, width, requires_grad=True)
    xs = [torch.randn(sequences, positions, width, requires_grad=True) for _ in range(MICROBATCHES)]
    work = MICROBATCHES * blocks  # blocks x micro-batches in each case
    cases = {
        "alone": lambda: [one(x).sum().backward() for _ in range(work)],
        "one at a time": lambda: [stack(m).sum().backward() for m in xs],
        "in flight": lambda: [out.backward() for out in [stack(m).sum() for m in xs]],
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / work)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=25, help="timed rounds, the cases taking turns")
    ap.add_argument("--host-memory", choices=("lean", "reuse", "glibc"), default="lean",
                    help="glibc's malloc as main.py sets it (observe/host_memory.py): lean (the "
                         "default of trainer.host_memory), reuse (trainer.host_memory=reuse), or "
                         "glibc's own defaults")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.host_memory != "glibc":
        return_large_frees()  # as main.py starts
    print(cpu_line())
    print(f"host memory: {args.host_memory}; {MICROBATCHES} micro-batches; ms per block per micro-batch "
          f"(x the block alone)")
    with reuse_step_memory(True) if args.host_memory == "reuse" else contextlib.nullcontext():
        for w, s, b, n in CASES:
            got = per_block_seconds(w, s, b, n, args.rounds)
            alone = got["alone"]
            cells = ", ".join(f"{name} {sec * 1e3:.3f} ({sec / alone:.2f}x)" for name, sec in got.items())
            print(f"width {w:3d}, {b} x {s} tokens, {n} blocks: {cells}; in flight / one at a time "
                  f"{got['in flight'] / got['one at a time']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
