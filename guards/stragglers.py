"""Stragglers named: which rank's own work is slow, though every rank's step takes as long.

In a synchronous job the collectives make every rank's step time equal: a slow GPU, a busy host or
a shared core slows every step, and metrics.jsonl's step_time_ms cannot say whose fault it is. What
differs is each rank's own compute time: the wall time of its forward, backward and optimizer work
minus the time it sat blocked in collectives waiting for the others.

On a CPU it is measured from the training thread's scheduler counters (Linux /proc/thread-self/schedstat):
time on a CPU plus time runnable but waiting for one (a core shared with another process), summed
over the window's train steps. A thread blocked in a collective sleeps and counts neither, so the
fast ranks' waiting drops out. CPU time alone would not do: a rank that shares its core with a busy
process needs the same CPU time per step but twice the wall time. Limits: this counts the
training thread only (trainer threads > 1 split the math over OpenMP workers, whose spin-waiting
would be noise: the tests and the ddp-on-CPU layouts run one thread per rank).

On a GPU the host thread only launches kernels and then waits, for its own GPU and for its peers
alike, so its clock would make every rank look the same. There the figure is the GPU time of the
transformer blocks' forward passes (`GpuBlockClock`: a CUDA event pair around each block's forward,
recorded by module hooks, read on log steps, when the step loop has synchronized anyway). The hooks
run after FSDP2's pre-forward hook (it waits for the all-gather) and after its post-forward hook, so
the waits for peers stay outside; what stays inside is the block's own math, and under tensor
parallelism its all-reduces (a tp peer's wait is counted there). A slow GPU is slow in forward as in
backward, so the forward's spread names it.

On log steps the per-step figures of every rank are gathered in one small collective (one float per
rank, on the control group); the row gets compute_ms_min / _median / _max and compute_slowest_rank,
and a rank slower than the median of the other ranks by more than SLOW_MARGIN for SLOW_WINDOWS log
windows in a row gets one warning line naming it (rank, host, local rank, how much slower). The
other ranks' median, not all ranks': at 2 ranks the median of both is their mean, which would hide a
rank half as fast.
"""
from __future__ import annotations

import os
import socket
import statistics
import threading
import time
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist

from parallel.env import control_group

SLOW_MARGIN = 0.20  # 20% above the median rank's compute time
SLOW_WINDOWS = 3  # ... in this many consecutive log windows


_SCHEDSTAT: dict[int, int] = {}  # thread id -> an open descriptor of its schedstat (a read is then ~5 us)


def thread_clock_ns() -> int:
    """On-CPU + run-queue nanoseconds of the calling thread (its wall time not spent sleeping); the
    thread's CPU time where the kernel keeps no scheduler counters."""
    tid = threading.get_native_id()
    try:
        if tid not in _SCHEDSTAT:
            _SCHEDSTAT[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        on_cpu, waiting, _ = os.pread(_SCHEDSTAT[tid], 128, 0).split()
        return int(on_cpu) + int(waiting)
    except (OSError, ValueError):
        return time.thread_time_ns()


class GpuBlockClock:
    """GPU milliseconds of the blocks' forward passes since the last read: a CUDA event pair around
    each block's forward (module hooks; `event` makes one: torch.cuda.Event(enable_timing=True))."""

    def __init__(self, blocks: list[torch.nn.Module], event=None):
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.timed_blocks = len(blocks)  # 0: nothing timed (a model compiled as one graph: launch/build.py)
        self._pairs: list[tuple] = []
        self._open: dict[int, object] = {}
        for block in blocks:  # registered after the data-parallel engine's own hooks: they run first
            block.register_forward_pre_hook(self._start)
            block.register_forward_hook(self._stop)

    # Outside any compiled graph (a block compiled in place traces its hooks): a graph break at the
    # block's edges, its body stays one graph.
    @torch.compiler.disable
    def _start(self, module, args) -> None:
        self._open[id(module)] = start = self._event()
        start.record()

    @torch.compiler.disable
    def _stop(self, module, args, output) -> None:
        end = self._event()
        end.record()
        self._pairs.append((self._open.pop(id(module)), end))

    def read_ms(self) -> float:
        """The milliseconds since the last read (the events must have completed: read after a sync)."""
        total = sum(start.elapsed_time(end) for start, end in self._pairs)
        self._pairs.clear()
        return total


class StragglerWatch:
    """One per rank: `timed()` around each train step, `row(step)` (collective) on log steps. With a
    `gpu_clock` (a GPU run) the figure is its blocks' forward GPU time instead of the thread clock."""

    def __init__(self, rank: int, world_size: int, local_rank: int, distributed: bool, announce: bool,
                 gpu_clock: GpuBlockClock | None = None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.distributed, self.announce = distributed, announce  # announce: this rank prints the warnings
        self._ns, self._steps = 0, 0
        self._slow_for: dict[int, int] = {}  # rank -> consecutive slow windows
        self._warned: set[int] = set()
        self._who: list[tuple[str, int]] | None = None
        self.gpu_clock = gpu_clock

    @contextmanager
    def timed(self):
        start = thread_clock_ns()
        try:
            yield
        finally:
            self._ns += thread_clock_ns() - start
            self._steps += 1

    def row(self, step: int) -> dict:
        """Collective. The spread of per-step compute time over ranks in this log window; nothing
        where a one-process GPU run's clock times no block (no figure beats a 0)."""
        if self.gpu_clock is not None and not self.gpu_clock.timed_blocks and not self.distributed:
            return {}
        ns = self.gpu_clock.read_ms() * 1e6 if self.gpu_clock is not None else self._ns
        mine = ns / max(1, self._steps) / 1e6
        self._ns, self._steps = 0, 0
        if not self.distributed:
            return {"compute_ms_min": mine, "compute_ms_median": mine, "compute_ms_max": mine,
                    "compute_slowest_rank": 0}
        if self._who is None:  # once: every rank's host and local rank, for the warning line
            self._who = [None] * self.world_size
            dist.all_gather_object(self._who, (socket.gethostname(), self.local_rank), group=control_group())
        parts = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world_size)]
        dist.all_gather(parts, torch.tensor([mine], dtype=torch.float64), group=control_group())
        ms = [float(p) for p in parts]
        median = statistics.median(ms)
        slowest = max(range(self.world_size), key=ms.__getitem__)
        self._note_slow(step, ms)
        return {"compute_ms_min": min(ms), "compute_ms_median": median, "compute_ms_max": ms[slowest],
                "compute_slowest_rank": slowest}

    def _note_slow(self, step: int, ms: list[float]) -> None:
        order = sorted(range(len(ms)), key=ms.__getitem__)
        position = {rank: i for i, rank in enumerate(order)}
        ranked = [ms[r] for r in order]
        for rank, value in enumerate(ms):
            others = median_without(ranked, position[rank])  # at 2 ranks: the other rank
            slow = others > 0 and value > (1 + SLOW_MARGIN) * others
            self._slow_for[rank] = self._slow_for.get(rank, 0) + 1 if slow else 0
            if self._slow_for[rank] >= SLOW_WINDOWS and rank not in self._warned and self.announce:
                self._warned.add(rank)
                host, local = self._who[rank]
                warnings.warn(f"straggler: rank {rank} (host {host}, local rank {local}) computes "
                              f"{100 * (value / others - 1):.0f}% slower than the median of the other ranks "
                              f"({value:.1f} vs {others:.1f} ms per step) for {SLOW_WINDOWS} log windows up to step "
                              f"{step}; every rank waits for it in each step's collectives (metrics.jsonl: "
                              f"compute_ms_*)", stacklevel=2)


def median_without(ranked: list[float], i: int) -> float:
    """The median of sorted `ranked` without its element at index i (O(1): no copy at 1,024 ranks)."""
    n = len(ranked) - 1
    if n == 0:
        return ranked[0]

    def at(k: int) -> float:  # the k-th element of the list without index i
        return ranked[k] if k < i else ranked[k + 1]
    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
