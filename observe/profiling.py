"""Profiles on demand (trainer.profile=START:STEPS): a torch profiler trace of steps START to
START+STEPS-1 on every rank, written to <run_dir>/profile/rank<R>.json, which Perfetto
(https://ui.perfetto.dev) and chrome://tracing open.

Each profiled step is one `step N` range in the trace, so a step's forward, backward, optimizer
and collectives (gloo or NCCL: `c10d::allreduce_`, `record_param_comms`, FSDP2's all-gathers, a
pipeline's sends and receives) line up under it. CPU activity always; CUDA kernels too on a GPU.
The profiler runs only inside those steps: every other step costs one comparison; a window past the
run's end is cut at its last step, where the trace is written, and the start-up view says so in a
`note:` line (profile_note), as it does for a window the run never reaches. Reading one step of
ddp, fsdp and a pipeline: docs/performance.md.
"""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from config import profile_window


class StepProfiler:
    """`around(step)` wraps each train step; the profiler runs only over the chosen steps."""

    def __init__(self, spec: str, run_dir: Path, rank: int, device: torch.device, max_steps: int):
        window = profile_window(spec)
        self.first, self.last = (window[0], window[0] + window[1] - 1) if window else (-1, -2)
        self.last = min(self.last, max_steps - 1)  # a window past the run's end ends with it (profile_note)
        self.path = run_dir / "profile" / f"rank{rank}.json"
        self.rank, self.device = rank, device
        self._profile: profile | None = None

    @contextmanager
    def around(self, step: int):
        """`step`: the optimizer step about to run (Trainer.step before it)."""
        if not self.first <= step <= self.last:
            yield
            return
        if self._profile is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profile = profile(activities=activities, record_shapes=True)
            self._profile.__enter__()
        with record_function(f"step {step}"):
            yield
        if step == self.last:
            self._write()

    def _write(self) -> None:
        prof, self._profile = self._profile, None
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        if self.rank == 0:
            print(f"profile: steps {self.first}-{self.last} written to {self.path.parent}/rank<R>.json "
                  f"(open in https://ui.perfetto.dev or chrome://tracing)", file=sys.stderr, flush=True)


def trace_names(path: Path) -> set[str]:
    """The event names of a written trace (for tests and quick looks)."""
    return {e.get("name", "") for e in json.loads(path.read_text(encoding="utf-8"))["traceEvents"]}


def profile_note(spec: str, step: int, max_steps: int) -> str | None:
    """The `note:` line of a trainer.profile window this launch (steps `step` to max_steps - 1)
    does not profile as written, or None: one wholly outside it (past the end, or before a resume's
    step), or one cut at the run's last step."""
    window = profile_window(spec)
    if window is None:
        return None
    first, last = window[0], window[0] + window[1] - 1
    asked = f"trainer.profile={spec} asks for steps {first}-{last}"
    if first >= max_steps or last < step:
        where = f"the run ends at step {max_steps}" if first >= max_steps else f"this launch starts at step {step}"
        return (f"note: {asked} but {where}: nothing is profiled; choose START from {step} to "
                f"{max_steps - 1}")
    if last >= max_steps:
        return f"note: {asked} but the run ends at step {max_steps}: steps {first}-{max_steps - 1} are profiled"
    return None
