"""Gathered Muon against Muon spread over the ranks: what each costs on this machine.

    python benchmarks/muon_spread.py             # 2 ranks (gloo), one thread each
    python benchmarks/muon_spread.py --nproc 4

Under fsdp, zero-3, HSDP and tp, parallel/muon.py gathers each hidden matrix whole (one
all-gather, needed either way) and every rank runs the same 5 Newton-Schulz iterations on it.
Spread (as modded-nanogpt's distributed Muon does it), each of n ranks would orthogonalise 1/n of
the matrices and send each result to the others: (1 - 1/n) of the iterations saved on every rank,
one more collective per matrix paid (here a broadcast of the orthogonalised matrix from its
owner). This measures both sides per matrix shape, on every rank at once (one thread each, as a
torchrun rank runs here), for the two models the docs use: nanoGPT's CPU model (4 blocks of 128)
and GPT-2 small (12 blocks of 768):

- the iterations: `parallel.muon.orthogonalize` in fp32 (what a CPU runs), median of repeats;
- a gloo broadcast of the whole matrix from rank 0, median of repeats;

and prints, per model and step, what spreading would save (+) or cost (-) on every rank:
sum over matrices of iterations x (1 - 1/n) - broadcast. A perfect balance of the matrices over
the ranks, all computing their shares at the same time, is assumed, which favours spreading: one
owner per matrix broadcasting before the next matrix measured slower than gathering
(docs/performance.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _repo  # noqa: F401  (the repository on sys.path)
import torch
import torch.distributed as dist

from parallel.muon import orthogonalize
from testing.local import torchrun_until

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
NS_STEPS = 5


def block_matrices(width: int) -> list[tuple[int, int]]:
    """The Muon matrices of one model.py block: q, k, v and the output projection (width x width),
    the MLP's fc (4 width x width) and proj (width x 4 width)."""
    return [(width, width)] * 4 + [(4 * width, width), (width, 4 * width)]


MODELS = {"nanoGPT CPU (4 x 128)": (4, 128), "GPT-2 small (12 x 768)": (12, 768)}


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def measure_shape(shape: tuple[int, int], repeats: int) -> tuple[float, float]:
    """(iterations ms, broadcast ms) of one matrix shape, the slowest rank's median of each."""
    g = torch.randn(shape)
    ns = median_ms(lambda: orthogonalize(g, NS_COEFFICIENTS, NS_STEPS, 1e-7, torch.float32), repeats)
    bcast = median_ms(lambda: dist.broadcast(g, src=0), repeats)
    worst = torch.tensor([ns, bcast], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst[0]), float(worst[1])


def worker(repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    shapes = sorted({s for _, width in MODELS.values() for s in block_matrices(width)})
    figures = {s: measure_shape(s, repeats) for s in shapes}
    if rank == 0:
        print(f"{n} ranks (gloo), 1 thread each | torch {torch.__version__}")
        print(f"{'matrix':>12s} {'iterations ms':>14s} {'broadcast ms':>13s} {'spread saves ms':>16s}")
        for s in shapes:
            ns, bcast = figures[s]
            print(f"{s[0]:>5d} x {s[1]:<5d} {ns:14.2f} {bcast:13.2f} {ns * (1 - 1 / n) - bcast:16.2f}")
        for name, (layers, width) in MODELS.items():
            mats = block_matrices(width) * layers
            ns = sum(figures[s][0] for s in mats)
            saved = sum(figures[s][0] * (1 - 1 / n) - figures[s][1] for s in mats)
            print(f"{name}: {len(mats)} matrices, iterations {ns:.1f} ms per step on every rank gathered; "
                  f"spread over {n} ranks would {'save' if saved > 0 else 'cost'} {abs(saved):.1f} ms per step")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default: 2)")
    ap.add_argument("--repeats", type=int, default=9, help="timed repeats per shape (default: 9)")
    args = ap.parse_args()
    if "RANK" in os.environ:
        worker(args.repeats)
        return 0
    if args.nproc < 2 or args.repeats < 1:
        ap.exit(2, "error: --nproc must be >= 2 and --repeats >= 1\n")
    return torchrun_until(args.nproc, [__file__, "--repeats", str(args.repeats)], 600).returncode


if __name__ == "__main__":
    sys.exit(main())
