"""Faults caused on purpose, for the tests: `MINGPT_FAULT=ACTION:WHERE:STEP:RANK`.

STEP may be '*'. Faults fire on the first launch attempt only, so a group that torchrun restarts
can finish. The places that call `fault_point` are the WHEREs: `save` (snapshots/store.py, right
after a rank wrote its shards of snapshot STEP, the folder still temporary) and `update`
(trainer.py, right after the optimizer step of STEP). Actions: `kill` SIGKILLs that rank; `term`
sends it a real SIGTERM; `nan` (at update) makes RANK's first weight NaN (only that rank's copy
or shard), as a diverged run would.
"""
from __future__ import annotations

import os
import signal
import sys

import torch

from parallel.dtensor import local_tensor
from parallel.env import restart_count


def fault_point(where: str, step: int, rank: int) -> str | None:
    """Do the `kill` or `term` asked for here; return any other matching action for the caller."""
    spec = os.environ.get("MINGPT_FAULT")
    if not spec or restart_count() != 0:
        return None
    action, at, at_step, at_rank = spec.split(":")
    if at != where or at_step not in ("*", str(step)) or int(at_rank) != rank:
        return None
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        print(f"[fault] rank {rank} sends itself SIGTERM at {where} of step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    return action


@torch.no_grad()
def poison_if_asked(step: int, rank: int, first_parameter: torch.Tensor) -> None:
    """`nan:update:STEP:RANK`: RANK's first weight becomes NaN after the update of STEP."""
    if fault_point("update", step, rank) == "nan":
        local_tensor(first_parameter).fill_(float("nan"))
