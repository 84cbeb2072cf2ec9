"""What one gloo collective costs between 2 local processes, per kind: all-reduce (DDP), all-gather (FSDP2,
ZeRO), all-to-all (the project's reduce-scatter on gloo, parallel/collectives.py), at a small payload (the
per-call latency) and large ones (the seconds per byte each rank sends), each call after ~7 ms of matmuls
as in a step (tools/calibrate.py times its all-reduce the same way).

    flock /tmp/mingpt-mp.lock python benchmarks/collective_rates.py

Prints, per kind and payload K, the mean seconds of a call and, for the large payloads, the rate in
bytes each rank sends per second: a ring at n = 2 sends K/2 per rank for an all-gather or all-to-all
and K for an all-reduce (K/2 in each of its two phases). planner/timing.py prices every kind with the
one all-reduce-calibrated link; a kind that runs slower per byte sent shows here.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)
import torch
import torch.distributed as dist

from tools.calibrate import collective_call
from tools.processes import child_env, multiprocess_lock

SIZES = (1024, 2 * 2**20, 8 * 2**20)  # fp32 elements: 4 KB (latency), 8 MB, 32 MB
CALLS = 8


def child(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    a = torch.randn(256, 256)
    for elems in SIZES:
        x, out = torch.randn(elems), torch.empty(elems)
        for kind in ("all-reduce", "all-gather", "all-to-all"):
            for _ in range(2):
                collective_call(kind, x, out)
            total = 0.0
            for _ in range(CALLS):
                for _ in range(20):  # about 7 ms of matmuls on one core, as between a step's collectives
                    a @ a
                dist.barrier()
                t0 = time.perf_counter()
                collective_call(kind, x, out)
                total += time.perf_counter() - t0
            mean = total / CALLS
            sent = 4 * elems * (1 if kind == "all-reduce" else 0.5)  # bytes one rank sends at n = 2
            if rank == 0:
                print(f"{kind:10s} K = {4 * elems / 1e6:8.3f} MB: {1e3 * mean:8.3f} ms per call, "
                      f"{sent / mean / 1e9:6.3f} GB/s sent per rank", flush=True)
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("0", "1"):  # one of the two processes started below
        return child(int(sys.argv[1]), sys.argv[2])
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    with tempfile.TemporaryDirectory() as tmp, multiprocess_lock():
        store = str(Path(tmp) / "store")
        env = child_env(OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, str(r), store], env=env) for r in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
    sys.exit(max(codes))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
