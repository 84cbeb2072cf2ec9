"""`HeldPeak`: the tensor bytes the process really holds through a step, from the allocator's side
(torch.profiler's memory events on CPU, the caching allocator's statistics on CUDA): what the
strategy's own tensors do not show (DDP's buckets, FSDP2's gathered parameters, temporaries) too.
benchmarks/strategy_report.py prints it beside the planned peak; tools/measure.py holds the rest of
the measuring side."""
from __future__ import annotations

import contextlib

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function


class HeldPeak:
    """`with HeldPeak(device) as h:` build the trainer, warm up, then `with h.window():` one step;
    after the block, h.start is the tensor bytes live when the window opened and h.peak the most
    live inside it, as the allocator counts them: every tensor, whoever holds it.

    CPU: torch.profiler with profile_memory=True records each allocation and free of c10's CPU
    allocator with its address and size, on the threads the profiler follows (the one that entered
    it, and autograd's). Entered before the model is built, it sees each of the layout's tensors
    allocated: live = sizes allocated since the profiler started less their frees, by address (a
    free of a block allocated before it, which torch reports only if it was profiled then too, is
    skipped). A free on a thread it does not follow (gloo's workers, when they drop a collective's
    last reference) is not reported: such a block counts as held until its address is handed out
    again, so the figure can only be too high (measured: DDP's construction broadcast buffer, 4a,
    on the receiving rank; a few of FSDP2's reduce-scatter buffers, varying from run to run;
    torch's profile_all_threads option reports no memory events at all in torch 2.13). Cost: about 4x the step's time while entered (measured on TINY); the window is a
    record_function range, and its allocation events are read from the profiler's event tree.
    CUDA: the caching allocator's statistics, memory_allocated at the window's start and
    max_memory_allocated after reset_peak_memory_stats there (the tensors of this device only)."""

    MARK = "HeldPeak.window"

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = torch.device(device)
        self.start = self.peak = 0
        self._prof = None if self.cuda else profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> HeldPeak:
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            if exc[0] is None:
                self.start, self.peak = _live_bytes(self._prof, self.MARK)

    @contextlib.contextmanager
    def window(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            with record_function(self.MARK):
                yield


def _walk(events):
    stack = list(events)
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.children)


def _live_bytes(prof, mark: str) -> tuple[int, int]:
    """(live CPU tensor bytes when the `mark` range began, the most live inside it) from a finished
    profile's allocation events."""
    events = sorted(_walk(prof.profiler.kineto_results.experimental_event_tree()), key=lambda e: e.start_time_ns)
    marks = [e for e in events if e.name == mark]
    if len(marks) != 1:
        raise RuntimeError(f"expected one {mark!r} range in the profile, found {len(marks)}")
    t0, t1 = marks[0].start_time_ns, marks[0].end_time_ns
    sizes: dict[int, int] = {}
    live = start = peak = 0
    for e in events:
        if e.typed[0] != _EventType.Allocation or e.typed[1].device.type != "cpu":
            continue
        a = e.typed[1]
        if a.alloc_size > 0:
            # an address handed out again was freed where the profiler did not see it
            live += a.alloc_size - sizes.get(a.ptr, 0)
            sizes[a.ptr] = a.alloc_size
        else:
            live -= sizes.pop(a.ptr, 0)
        if e.start_time_ns < t0:
            start = live
        elif e.start_time_ns <= t1:
            peak = max(peak, live)
    return start, max(peak, start)
