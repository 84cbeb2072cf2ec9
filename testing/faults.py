"""Faults caused on purpose, for the tests: `MINGPT_FAULT=ACTION:WHERE:STEP:RANK[,ACTION:WHERE:STEP:RANK...]`.

STEP may be '*'. Faults fire on the first launch attempt only, so a group that torchrun restarts
can finish. `install` (run at start-up in every process the tests start: testing/boot/sitecustomize.py) puts them into the hook points of
observe/hooks.py when MINGPT_FAULT is set; each point reads MINGPT_FAULT again when reached. The
WHEREs are those points: `train` (trainer.py, the model built, before the loop's first step:
STEP is the step it starts at), `save` (snapshots/store.py, right after a rank wrote its shards of
snapshot STEP, the folder still temporary; on a background save snapshots/writer.py, once
every rank's write is done, before rank 0's commit; for `eio`, the `snapshot_filesystem` point:
inside that rank's write of them, snapshots/writer.py), `write` (snapshots/writer.py, as a rank
starts writing its files of snapshot STEP: on a background save, while training goes on) and
`update` (trainer.py, right after the optimizer step of STEP). Actions: `kill` SIGKILLs that rank;
`term` sends it a real SIGTERM; `stop` sends it a real SIGSTOP (alive, frozen: a stuck driver);
`flip` (at update) flips one bit of one element of RANK's first LayerNorm weight (silent data
corruption); `block` blocks its training thread on a lock forever, outside any collective (a
deadlock; its other threads run on); `nan` (at update) makes RANK's first weight NaN (only that
rank's copy or shard), as a diverged run would; `eio` (at save) makes every write of RANK's
snapshot files raise OSError(EIO) from the file object DCP writes into, as a failing disk or a lost
network mount would (this machine cannot cause one for real).
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from contextlib import contextmanager

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from observe import hooks
from parallel.dtensor import local_tensor
from parallel.env import restart_count


def fault_asked(where: str, step: int, rank: int) -> str | None:
    """The action MINGPT_FAULT asks for here (None: none), without doing it. MINGPT_FAULT may hold
    several specs, comma-separated; the first that matches here wins."""
    specs = os.environ.get("MINGPT_FAULT")
    if not specs or restart_count() != 0:
        return None
    for spec in specs.split(","):
        action, at, at_step, at_rank = spec.strip().split(":")
        if at == where and at_step in ("*", str(step)) and int(at_rank) == rank:
            return action
    return None


def fault_point(where: str, step: int, rank: int) -> str | None:
    """Do the `kill` or `term` asked for here; return any other matching action for the caller."""
    action = fault_asked(where, step, rank)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        print(f"[fault] rank {rank} sends itself SIGTERM at {where} of step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "stop":
        print(f"[fault] rank {rank} sends itself SIGSTOP at {where} of step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "block":
        print(f"[fault] rank {rank} blocks on a lock at {where} of step {step}", file=sys.stderr, flush=True)
        block_forever()
    return action


def block_forever() -> None:
    """A deadlock: the second acquire of a plain lock never returns (and releases the GIL)."""
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


FLIPPED_BIT = 22  # the top mantissa bit of a float32: the value changes by up to half, stays finite


@torch.no_grad()
def poison_if_asked(step: int, rank: int, module: torch.nn.Module) -> None:
    """At the update of STEP on RANK: `nan` makes the module's first weight NaN; `flip` flips one
    bit of one element of its first LayerNorm weight (a tensor every layout but plain FSDP keeps
    replicated somewhere: over dp, tp or HSDP's replicas), as a bit flip in memory would."""
    action = fault_point("update", step, rank)
    if action == "nan":
        local_tensor(next(module.parameters())).fill_(float("nan"))
    elif action == "flip":
        name, weight = next((n, p) for n, p in module.named_parameters() if "ln" in n and n.endswith("weight"))
        bits = local_tensor(weight).view(-1).view(torch.int32)
        bits[0] ^= 1 << FLIPPED_BIT
        print(f"[fault] rank {rank} flips bit {FLIPPED_BIT} of {name}[0] after the update of step {step}",
              file=sys.stderr, flush=True)


class _EIOStream:
    """A real open file whose writes fail as a disk's I/O error does: the file exists, empty."""

    def __init__(self, stream, path):
        self._stream, self._path = stream, str(path)

    def write(self, data) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO), self._path)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class EIOFileSystem(FileSystem):
    """DCP's local filesystem for `eio:save`: files are created, every write to them fails."""

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _EIOStream(stream, path) if "w" in mode else stream


def eio_filesystem_if_asked(fs: FileSystem, step: int, rank: int) -> FileSystem:
    """The `snapshot_filesystem` point: EIOFileSystem for the writer of snapshot STEP on RANK when
    `eio:save:STEP:RANK` is asked for, else `fs` unchanged."""
    return EIOFileSystem() if fault_asked("save", step, rank) == "eio" else fs


def install() -> None:
    """Put the faults into the hook points of observe/hooks.py when MINGPT_FAULT is set (nothing
    when it is not, so a handler a test installed stays). Run at start-up by every process the
    tests start (testing/boot/sitecustomize.py); a test that runs the app in its own process calls
    it after setting MINGPT_FAULT."""
    if not os.environ.get("MINGPT_FAULT"):
        return
    hooks.install("train", fault_point)
    hooks.install("save", fault_point)
    hooks.install("write", fault_point)
    hooks.install("update", poison_if_asked)
    hooks.install("snapshot_filesystem", eio_filesystem_if_asked)
