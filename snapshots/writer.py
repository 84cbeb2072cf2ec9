"""Writing one snapshot's files: DCP's file writer that reports the OSError behind a failed write,
and rank 0's commit (hashes into meta.json, then the one rename that makes it a snapshot).

torch.save, which DCP writes each file with, turns a failed write of its zip container into a
RuntimeError ("unexpected pos ...") raised while handling the real OSError (ENOSPC, EIO, ...).
DCP sends each rank's exception to the others pickled, which drops that context, so the rank that
met the error raises the OSError itself here and every rank's CheckpointException carries it
(storage/failures.py finds it). The `eio:save:STEP:RANK` fault (testing/faults.py, through the
`snapshot_filesystem` hook point of observe/hooks.py) swaps in a filesystem whose writes fail on
that rank only.

Snapshots in the background (trainer.async_save): the step loop waits only for the copy.

A synchronous save stops every rank for the whole write (GPT-2 XL with AdamW: ~19 GB per
snapshot). Here `start` copies this rank's state into CPU memory (DCP's async_save stages it:
the loop may change its tensors as soon as it returns), then DCP writes the files on a thread of
its own, over a gloo process group of its own (its collectives never interleave with the
training's), and rank 0 commits when the write is done: meta.json with every file's sha256, then
the one rename that makes the temporary folder a snapshot (`SnapshotWriter`, `rename_into_place` above). Until that rename
no resume sees it; a SIGKILL at any point leaves at most a temporary folder, which the next save
removes.

The copy goes to fresh pageable host memory (DCP's default staging). Pinned staging reused from
save to save (DCP's DefaultStager with use_pinned_memory) would copy faster, but on torch 2.11 +
CUDA 13 on an H100 it hung at the first background save, the whole process stopped (the hang
watchdog's thread too, so the GIL was held), with and without FSDP's CPU offload; DCP's default
staging passed the same run (scripts/gpu_check.sh, docs/gpu-check.md).

At most one save is in flight: `start` first waits for the previous one. `wait` (every rank, at the
next save and at the end of training: the final or stop snapshot is waited for before the run's
closing line) returns the finished save's timings, or raises StorageError on every rank when its
write or its commit failed on any rank: rank 0's outcome is broadcast, as a synchronous save does.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from observe import hooks
from parallel.env import new_group
from snapshots.format import META
from storage.failures import StorageError, os_error_in
from storage.files import atomic_write_text, fsync_dir, sha256_file


def _reraise_os_error(e: BaseException) -> None:
    """Raise the OSError behind `e` in its place (the caller raises `e` when there is none)."""
    cause = os_error_in(e)
    if cause is not None and cause is not e:
        raise cause from None


class SnapshotWriter(FileSystemWriter):
    """DCP's FileSystemWriter (one file per rank, fsynced) for snapshot `step` on `rank`."""

    def __init__(self, path: Path, step: int, rank: int):
        super().__init__(path)
        self.step, self.rank = step, rank
        self.fs = hooks.snapshot_filesystem(self.fs, step, rank)  # testing/faults.py's eio: one whose writes fail

    def write_data(self, plan, planner):
        hooks.at("write", self.step, self.rank)  # a fault's kill or signal before this rank's files are written
        try:
            return super().write_data(plan, planner)
        except Exception as e:
            _reraise_os_error(e)
            raise

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as e:
            _reraise_os_error(e)
            raise


def write_record(tmp: Path, record: dict) -> int:
    """Rank 0, once every rank's files are in `tmp`: fsync and hash each into meta.json (written
    whole, durable). Returns the snapshot's size in bytes."""
    files = {}
    for f in sorted(tmp.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[f.name] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    atomic_write_text(tmp / META, json.dumps({**record, "files": files}, indent=1, ensure_ascii=False),
                      durable=True)
    fsync_dir(tmp)
    return sum(r["size"] for r in files.values()) + (tmp / META).stat().st_size


def rename_into_place(tmp: Path, final: Path) -> None:
    """The commit point: `tmp` becomes `final` in one rename. A valid snapshot already at `final`
    (the one this launch resumed from, saved again) is renamed out of the way first and put back
    if the commit fails, so no failure leaves the step without its snapshot."""
    old = final.with_name(f".tmp-replaced-{final.name}")
    if final.exists():
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        if old.exists():
            os.rename(old, final)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


@dataclass
class SaveTiming:
    step: int
    blocking_ms: float  # the step loop waited this long (the copy to CPU memory)
    total_ms: float  # from the start to the commit


class BackgroundSaves:
    """One rank's in-flight background save (at most one)."""

    def __init__(self, rank: int, distributed: bool, commit: Callable[[Path, Path, dict], None]):
        self.rank, self.distributed, self._commit = rank, distributed, commit  # commit: rank 0's meta.json + rename + prune
        self._group = None
        self._done = threading.Event()
        self._done.set()
        self._failure: BaseException | None = None
        self._finished_at = 0.0
        self._pending: tuple[int, Path, float, float] | None = None  # step, tmp, start, blocking seconds

    def start(self, step: int, tensors: dict, tmp: Path, final: Path, record: dict) -> float:
        """Copy `tensors` and write them in the background; returns the seconds the caller was blocked."""
        if self.distributed and self._group is None:  # collective: every rank saves at the same steps
            self._group = new_group(backend="gloo")
        start = time.perf_counter()
        self._done.clear()
        self._failure = None
        future = dcp.async_save(tensors, storage_writer=SnapshotWriter(tmp, step, self.rank),
                                process_group=self._group, no_dist=not self.distributed)
        blocking = time.perf_counter() - start
        self._pending = (step, tmp, start, blocking)
        future.add_done_callback(lambda f: self._finish(f, step, tmp, final, record))
        return blocking

    def _finish(self, future, step: int, tmp: Path, final: Path, record: dict) -> None:
        """DCP's thread, once every rank's files are written (DCP's finish gathers them all)."""
        try:
            future.result()
            hooks.at("save", step, self.rank)
            if self.rank == 0:
                self._commit(tmp, final, record)
        except BaseException as e:  # kept for wait(), which every rank reaches
            self._failure = e
        finally:
            self._finished_at = time.perf_counter()
            self._done.set()

    def drain(self) -> None:
        """Not collective: wait until this rank's background write (and rank 0's commit) ended,
        for a launch that ends on an error and must not release the run folder mid-write."""
        self._done.wait()

    def wait(self, newest: Path | None, snap_dir: Path) -> SaveTiming | None:
        """Collective when a save was started. The finished save's timing; StorageError on every
        rank if it failed anywhere (`newest`: the snapshot that stays the resume point)."""
        if self._pending is None:
            return None
        step, tmp, start, blocking = self._pending
        self._pending = None
        self._done.wait()
        failure = self._failure
        total = self._finished_at - start
        cause = os_error_in(failure) if failure is not None else None
        if failure is not None and cause is None:
            raise failure
        mine = (cause.errno, cause.strerror, str(cause.filename or tmp)) if cause is not None else None
        if self.distributed:  # rank 0's commit (and DCP's shared failure) decide for every rank
            box = [mine]
            dist.broadcast_object_list(box, src=0)
            mine = mine or box[0]
        if mine is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise StorageError(f"snapshot step {step}", snap_dir, OSError(*mine), newest)
        return SaveTiming(step, 1000 * blocking, 1000 * total)
