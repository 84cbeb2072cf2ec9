"""Named hook points: the moments of a run where code installed from above may act, called by the
lower layers that reach them. Nothing is installed by default, and then every hook does nothing
but one dict look-up. testing/faults.py installs the faults of MINGPT_FAULT here (launch/app.py
calls it first); a test may install its own handler to act at one moment (turn a filesystem
read-only at the save of step 10).

    point                caller                                  the moment
    train                at("train", step, rank)                 trainer.py: the model is built (and resumed at
                                                                 `step`), before the loop's first step
    save                 at("save", step, rank)                  snapshots/store.py: a rank wrote its shards of
                                                                 snapshot `step`, the folder still temporary;
                                                                 snapshots/writer.py: the background write of
                                                                 `step` is done on every rank, before rank 0's commit
    write                at("write", step, rank)                 snapshots/writer.py: a rank starts writing its
                                                                 files of snapshot `step` (a background save: on
                                                                 DCP's thread, while training goes on)
    update               after_update(step, rank, module)        trainer.py: right after the optimizer step of
                                                                 `step`; `module` is the rank's model
    snapshot_filesystem  snapshot_filesystem(fs, step, rank)     snapshots/writer.py: DCP's FileSystem that a rank's
                                                                 writer of snapshot `step` writes through; the
                                                                 handler returns the one to use

A handler of `train`, `save` and `write` is called with (where, step, rank), of `update` with (step, rank,
module), of `snapshot_filesystem` with (fs, step, rank).

Why in observe/: the package holds what watches a run (non-finite values, replicas that disagree,
stragglers); these are the moments a run can be watched at, or disturbed at to check that the
watching works. This module imports nothing of the project (and observe/__init__.py nothing at
all), so snapshots/ and trainer.py call it without depending on launch/ or on the rest of observe/;
tests/test_structure.py checks both.
"""
from __future__ import annotations

from typing import Callable

POINTS = ("train", "save", "write", "update", "snapshot_filesystem")
HANDLERS: dict[str, Callable] = {}  # point -> its one handler; a point without one does nothing


def install(point: str, handler: Callable) -> None:
    """Make `handler` the handler of `point` (it replaces the one installed there)."""
    if point not in POINTS:
        raise ValueError(f"no hook point {point!r}; the points: {', '.join(POINTS)}")
    HANDLERS[point] = handler


def at(where: str, step: int, rank: int) -> None:
    """The `train` moment (the loop starts at `step`), or the `save` or `write` moment of snapshot `step`, on `rank`."""
    handler = HANDLERS.get(where)
    if handler is not None:
        handler(where, step, rank)


def after_update(step: int, rank: int, module) -> None:
    """Right after the optimizer step of `step` on `rank`."""
    handler = HANDLERS.get("update")
    if handler is not None:
        handler(step, rank, module)


def snapshot_filesystem(fs, step: int, rank: int):
    """The FileSystem that `rank`'s writer of snapshot `step` writes through: `fs` itself unless a
    handler returns another."""
    handler = HANDLERS.get("snapshot_filesystem")
    return fs if handler is None else handler(fs, step, rank)
