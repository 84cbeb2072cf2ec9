"""What the step loop measures besides the loss: the speed of the steps since the last log step
(`StepWindow`), the memory a rank really uses (`memory_row`: metrics.jsonl's `*_mb` columns, in
MB = 10^6 bytes, the unit of --plan and the strategy report, so their figures compare as they are),
and how the loop ended (`RunSummary`)."""
from __future__ import annotations

import dataclasses
import resource
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.strategy import Strategy

MB = 10**6  # every memory figure the project prints or logs: SI megabytes, as planner/units.py


def rss_peak_bytes() -> int:
    """Peak resident set size of this process: every byte it touched (interpreter, libraries,
    allocator caches, communication buffers), not only the training tensors."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class CudaPeaks:
    """The CUDA allocator's peak per log window and over the run. torch keeps one peak since the
    process started (or since its last reset), which set-up and the first steps dominate: each
    window's figure is read, then the counter is reset, so a window reports the steps it holds."""

    def __init__(self):
        self.run_peak = 0

    def window(self, device: torch.device) -> tuple[int, int]:
        """(bytes allocated at most since the last call, at most since the process started)."""
        peak = torch.cuda.max_memory_allocated(device)
        self.run_peak = max(self.run_peak, peak)
        torch.cuda.reset_peak_memory_stats(device)
        return peak, self.run_peak


def memory_row(strategy: Strategy, held: dict[str, int], cuda_peaks: CudaPeaks) -> dict[str, float]:
    """Collective over all ranks. MB (10^6 bytes), max over ranks: the process's peak RSS since it
    started (`rss_peak_mb`: host memory, the whole process's, never reset), the tensor bytes the
    strategy holds (`held`: Strategy.resident_bytes; params, grads, optimizer state: comparable
    across strategies), and on CUDA the allocator's peak over the steps since the last row
    (`cuda_peak_allocated_mb`) and over the whole process (`cuda_run_peak_allocated_mb`)."""
    row = {"rss_peak_mb": rss_peak_bytes(), "held_params_mb": held.get("params", 0),
           "held_grads_mb": held.get("grads", 0), "held_optim_mb": held.get("optimizer", 0)}
    if strategy.device.type == "cuda":
        row["cuda_peak_allocated_mb"], row["cuda_run_peak_allocated_mb"] = cuda_peaks.window(strategy.device)
    values = [float(v) for v in row.values()]  # bytes: exact in float64 up to 8 PiB
    if strategy.env.distributed:
        t = torch.tensor(values, dtype=torch.float64, device=strategy.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = t.tolist()
    return {k: v / MB for k, v in zip(row, values)}


@dataclass
class StepWindow:
    """Train-step seconds since the last log step. On CUDA only a window's end is synchronized
    (Trainer._step_seconds), so single steps are not timed: only windows are."""
    seconds: float = 0.0
    steps: int = 0
    closed: list[float] = field(default_factory=list)  # seconds per step of each closed window

    def add(self, seconds: float) -> None:
        self.seconds, self.steps = self.seconds + seconds, self.steps + 1

    def close(self) -> float:
        """Seconds per step of this window; a new window starts."""
        mean = self.seconds / self.steps
        self.closed.append(mean)
        self.seconds, self.steps = 0.0, 0
        return mean

    def median(self) -> float:
        return sorted(self.closed)[len(self.closed) // 2] if self.closed else 0.0


@dataclass
class RunSummary:
    """How the step loop ended: `stopped` by a signal (its number; `snapshot` holds that step), or
    finished (`val_loss` and the speed of the run)."""
    final_step: int
    stopped: int = 0
    snapshot: str | None = None
    val_loss: float | None = None
    median_step_ms: float | None = None
    tokens_per_sec: float | None = None

    def metrics(self) -> dict[str, float | int]:
        """The tracker's summary: every figure that was measured."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None and k in ("final_step", "val_loss", "median_step_ms", "tokens_per_sec")}
