"""Writing one snapshot's files: DCP's file writer that reports the OSError behind a failed write,
and rank 0's commit (hashes into meta.json, then the one rename that makes it a snapshot).

torch.save, which DCP writes each file with, turns a failed write of its zip container into a
RuntimeError ("unexpected pos ...") raised while handling the real OSError (ENOSPC, EIO, ...).
DCP sends each rank's exception to the others pickled, which drops that context, so the rank that
met the error raises the OSError itself here and every rank's CheckpointException carries it
(storage/failures.py finds it). The `eio:save:STEP:RANK` fault (testing/faults.py, through the
`snapshot_filesystem` hook point of observe/hooks.py) swaps in a filesystem whose writes fail on
that rank only.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

from observe import hooks
from snapshots.meta import META
from storage.failures import os_error_in
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
