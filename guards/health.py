"""Is the run still sound? Checks every rank agrees on before anything is saved.

`FiniteCheck`: a non-finite loss (nan or inf) is remembered on the device at no cost per step;
on log and save steps the ranks agree (one MIN all-reduce) on the first bad step, and before a
snapshot they also check the parameters, so a diverged state never becomes the resume point.
A failure raises `NonFiniteError` on every rank at once (launch/errors.py: one line, exit 1).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from parallel.dtensor import local_tensor
from parallel.strategy import Strategy

_NEVER = 2**62  # "no bad step yet" in a MIN-reduced step number


class NonFiniteError(Exception):
    """The training diverged; raised on every rank at once (the ranks agree before raising)."""

    def __init__(self, what: str, last_snapshot: Path | None):
        super().__init__(what)
        self.what, self.last_snapshot = what, last_snapshot


class FiniteCheck:
    def __init__(self, strategy: Strategy):
        self.strategy = strategy
        # the first step whose loss was not finite on this rank, kept on the device (no sync per step)
        self.bad_loss_step = torch.full((), _NEVER, dtype=torch.int64, device=strategy.device)

    def note_loss(self, loss: torch.Tensor, step: int) -> None:
        """Remember the first step whose loss on this rank was not finite, on the device: no sync
        here; it is agreed by `check` on log and save steps only."""
        self.bad_loss_step.masked_fill_(~torch.isfinite(loss.detach()) & (self.bad_loss_step == _NEVER), step)

    @torch.no_grad()
    def flags(self, step: int, params: bool) -> torch.Tensor:
        """This rank's [first bad loss step] (+ [step, or _NEVER when every parameter is finite] with
        `params`), on the training device. Parameters may live on another device than the loss (FSDP's
        CPU offload keeps them in host memory on a GPU run): each device's verdict is moved over."""
        bad = [self.bad_loss_step]
        if params:
            on: dict[torch.device, list[torch.Tensor]] = {}
            for p in {id(p): p for part in self.strategy.unwrapped() for p in part.parameters()}.values():
                on.setdefault(local_tensor(p).device, []).append(local_tensor(p))
            finite = torch.ones((), dtype=torch.bool, device=self.bad_loss_step.device)
            for tensors in on.values():
                finite &= torch.stack([t.isfinite().all() for t in tensors]).all().to(finite.device)
            bad.append(torch.where(finite, _NEVER, step))
        return torch.stack(bad)

    @torch.no_grad()
    def check(self, step: int, last_snapshot: Path | None, params: bool) -> None:
        """Collective. Raises NonFiniteError on every rank if any rank saw a non-finite loss since
        the run's start (all ranks agree on the first such step), or with `params`, if any
        rank's parameters are not finite now. `last_snapshot`: the resume point the error names."""
        s = self.strategy
        flags = self.flags(step, params)
        if s.env.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        loss_step, param_step = (flags.tolist() + [_NEVER])[:2]
        if loss_step == _NEVER and param_step == _NEVER:
            return
        what = (f"the loss became non-finite (nan or inf) at step {loss_step}" if loss_step != _NEVER
                else f"the parameters became non-finite (nan or inf) in the update of step {param_step}")
        raise NonFiniteError(what, last_snapshot)
