"""One GPT block's forward + backward alone, one thread, across widths and block lengths: the fraction of
the matmul peak it reaches and what remains per activation element beyond its FLOPs.

    flock /tmp/mingpt-mp.lock python benchmarks/block_widths.py

Per (width, positions, sequences): the best of 5 timed runs, its efficiency (3 x forward FLOPs, 24 h^2 +
4 s h per token, over the CPU's fp32 peak, less the fixed per-block overhead of a 32-wide block on 16
tokens), and the seconds per token x width left after pricing the FLOPs at 0.9 of the peak. The planner
prices a block as FLOPs / (peak x efficiency) + tokens x width x elementwise + overhead (planner/compute.py);
this shows why one efficiency cannot serve every width: the element-wise work grows as T h, the matmuls
as T h^2.
"""
from __future__ import annotations

import argparse

import _repo  # noqa: F401  (the repository on sys.path)
import torch

from observe.perf import cpu_peak
from tools.calibrate import measure_block

SHAPES = [(64, 32, 8), (64, 64, 8), (64, 128, 8), (128, 128, 8), (128, 256, 4), (256, 32, 8), (256, 64, 8),
          (256, 128, 8), (256, 256, 4), (512, 128, 4), (512, 256, 2)]  # width, positions, sequences


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(1)
    peak = cpu_peak("fp32")[0]
    overhead = measure_block(32, 16, 1, repeats=20)
    print(f"fp32 peak {peak / 1e9:.1f} GFLOP/s (1 thread), per-block overhead {overhead * 1e3:.3f} ms")
    for w, s, b in SHAPES:
        t = measure_block(w, s, b, repeats=5)
        flops = 3 * b * s * (24 * w * w + 4 * s * w)
        rest = (t - overhead - flops / (0.9 * peak)) / (b * s * w)
        print(f"width {w:4d}, block {s:4d}, {b} sequences: {t * 1e3:8.3f} ms, efficiency "
              f"{flops / peak / max(t - overhead, 1e-9):.3f}, left per token x width at 0.9 of the peak {rest * 1e9:.1f} ns")


if __name__ == "__main__":
    main()
