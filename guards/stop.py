"""A stop signal during training: recorded (`StopRequest`, the handler), then agreed by every rank
(`StopVote`), so all stop after the same step and save it. What a stopped launch prints, and the
handling outside the step loop, are launch/stopping.py's."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.env import control_group


class StopRequest:
    """A signal handler (launch/app.py installs it for SIGTERM and SIGINT during training) that only records the
    first signal's number. Nothing is interrupted: not a step, not a collective, not a snapshot write
    (a second signal during the stop snapshot changes nothing); the loop reads it between steps."""

    def __init__(self):
        self.signum = 0

    def __call__(self, signum, frame) -> None:
        self.signum = self.signum or signum


class StopVote:
    """Every rank must stop at the same step, or the others would wait forever in the next step's
    collectives. The ranks agree with a MAX all-reduce of the recorded signal number on a gloo
    group (CPU tensor: no GPU sync), started asynchronously after step k and read after step k+1,
    so the vote's latency hides behind a whole step. A signal thus stops the run one or two steps
    after it arrives. One process needs no vote."""

    def __init__(self, request: StopRequest, distributed: bool):
        self.request, self.pending = request, None
        self.group = control_group() if distributed else None

    def start(self) -> None:
        if self.group is not None:
            flag = torch.tensor([self.request.signum], dtype=torch.int32)
            self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)

    def result(self) -> int:
        """The agreed signal number (0: go on)."""
        if self.group is None:
            return self.request.signum
        if self.pending is None:
            return 0
        work, flag = self.pending
        work.wait()
        self.pending = None
        return int(flag.item())
