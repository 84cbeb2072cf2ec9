"""Storage failures: a write the filesystem refused (full, read-only, no permission, an I/O error),
found behind whatever wraps it, and the one line a run stops with.

A run stops on one with exit code STORAGE_EXIT and one line: what could not be written and where,
the error's words, the snapshot that stays the resume point (nothing valid is ever lost: a
snapshot is committed by one rename after its files are complete) and the fix, which depends on
the error: free space for a full disk or quota, remount for a read-only filesystem, permissions
for EACCES/EPERM, and a look at the storage for anything else (EIO: a failing disk or a lost
network mount). The relaunch is always the same command: it resumes from the snapshot named.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterable

from torch.distributed.checkpoint.api import CheckpointException

STORAGE_EXIT = 3  # exit code of a launch stopped by a storage failure (README: exit codes)

_FIXES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space (or raise the quota)",
    errno.EROFS: "make the filesystem writable again (remount it read-write)",
    errno.EACCES: "give this user write permission on {where}",
    errno.EPERM: "give this user write permission on {where}",
}
_CHECK_STORAGE = "check the storage (an I/O error: a failing disk or a lost network mount)"


def os_error_in(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`: itself, one it was raised from or while handling (torch.save turns
    a failed write into a RuntimeError raised while handling the OSError), or the lowest rank's
    inside DCP's CheckpointException (which carries each rank's exception)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            found = (os_error_in(e.failures[r][0]) for r in sorted(e.failures))
            return next((f for f in found if f is not None), None)
        e = e.__cause__ or e.__context__
    return None


def error_words(e: OSError) -> str:
    """'No space left on device': the error as the system words it, without paths."""
    return e.strerror or str(e) or type(e).__name__


def fix_for(e: OSError, where: Path) -> str:
    return _FIXES.get(e.errno, _CHECK_STORAGE).format(where=where)


def resume_point_words(snapshot: Path | None) -> str:
    if snapshot is None:
        return "no valid snapshot exists yet, so a relaunch starts again from step 0"
    return f"nothing was lost: the newest valid snapshot {snapshot} stays the resume point"


class StorageError(Exception):
    """A snapshot (or the room for one) the storage refused; raised on every rank alike."""

    def __init__(self, what: str, where: Path, error: OSError, resume_point: Path | None, detail: str = ""):
        self.errno = error.errno
        super().__init__(f"cannot write {what} to {where} ({error_words(error)}{detail}); "
                         f"{resume_point_words(resume_point)}; {fix_for(error, where)} and relaunch "
                         f"the same command")


def _bytes_under(folders: Iterable[Path]) -> int:
    return sum(f.stat().st_size for d in folders for f in d.rglob("*") if f.is_file())


def room_problem(folder: Path, need: int, reclaimable: Iterable[Path] = ()) -> tuple[OSError, str] | None:
    """Why `folder` cannot take `need` more bytes: (the error a write would meet, a detail for the
    line), or None when it can or cannot tell (a filesystem that reports no sizes, as some network
    and FUSE mounts do). The `reclaimable` folders count as free: the next write removes them."""
    if not os.access(folder, os.W_OK | os.X_OK):
        code = errno.EROFS if os.statvfs(folder).f_flag & os.ST_RDONLY else errno.EACCES
        return OSError(code, os.strerror(code), str(folder)), ""
    st = os.statvfs(folder)
    if st.f_blocks == 0:
        return None
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use the reserved blocks
    free = blocks * st.f_frsize + _bytes_under(reclaimable)
    if free >= need:
        return None
    return (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder)),
            f": {_mb(free)} free, a snapshot takes {_mb(need)}")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
