"""One run folder, one launch: an exclusive lock on `<run_dir>/launch.lock` for the whole launch.

Two launches writing one run folder delete each other's in-flight snapshots and metrics, so the
second one is refused before it reads or writes anything there. The lock is `fcntl.flock`: the
kernel drops it when the holding process dies, however it dies (SIGKILL included), so a killed
job never leaves a stale lock and the workers that torchrun restarts take it again. The lock
belongs to the job, not to a node: global rank 0 takes it and broadcasts the verdict, so all
ranks of every node go on or refuse together.

The lock file stays in the folder (it is empty and never rewritten), except that a launch which
created the folder and was refused removes it again (file and folder) so it leaves no trace. A
launch that opened the file just before that removal would then lock a deleted file, so after
`flock` succeeds the lock is checked to still be the file at the path (same inode); if not, the
launch starts over.

A torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) waits up to RESTART_LOCK_WAIT_S for the lock
instead of refusing at once: on one machine the failed attempt's lock is gone when its process
dies, but on a network filesystem the lock of a lost node's process lives until the server's lease
expires (NFSv4: 90 s by default), and refusing would spend the job's --max-restarts on it. A first
launch never waits: a folder in use is another job's.
"""
from __future__ import annotations

import errno
import fcntl
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from config import UsageError
from parallel.env import restart_count

LOCK_FILE = "launch.lock"
RESTART_LOCK_WAIT_S = 150.0  # above NFSv4's default 90 s lease (module doc)


def restart_lock_wait() -> float:
    """Seconds this launch may wait for the lock: RESTART_LOCK_WAIT_S in a torchrun restart, else 0."""
    return RESTART_LOCK_WAIT_S if restart_count() > 0 else 0.0


class RunLock:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None
        self._created: list[Path] = []  # folders this launch made, deepest first

    def acquire(self, attempt: int = 1, wait_s: float = 0.0) -> None:
        """Create the run folder if needed and lock it; a UsageError when that is impossible or
        another launch holds the lock (after waiting up to `wait_s` for it)."""
        run_dir = self.run_dir
        try:
            if run_dir.is_file():
                raise UsageError(f"trainer.run_dir '{run_dir}' is a file; point it at a folder")
            missing, p = [], run_dir
            while not p.exists() and p != p.parent:
                missing.append(p)
                p = p.parent
            for d in reversed(missing):
                try:
                    d.mkdir()
                except FileExistsError:  # another launch made it meanwhile: not ours to remove
                    continue
                self._created.insert(0, d)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if not os.access(run_dir, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(run_dir))
        except OSError as e:
            self.release()
            where = f": {e.filename}" if e.filename else ""
            raise UsageError(f"cannot create or write trainer.run_dir '{run_dir}' ({e.strerror or e}"
                             f"{where}); point it at a folder this user can create and write") from None
        try:
            self._flock(wait_s)
            if not self._locks_the_current_file():
                # a refused launch that created the folder removed it (and this file) meanwhile
                os.close(self._fd)
                self._fd = None
                if attempt < 3:
                    return self.acquire(attempt + 1, wait_s)
                raise BlockingIOError
        except BlockingIOError:
            self.release()
            raise UsageError(f"trainer.run_dir '{run_dir}' is in use by another launch (it holds the "
                             f"lock on {self.path}); wait until that launch ends or stop it, or pick "
                             f"another trainer.run_dir") from None
        except OSError as e:  # a filesystem without file locks (e.g. Lustre mounted without flock)
            self.release()
            raise UsageError(f"cannot lock {self.path} ({e.strerror or e}); point trainer.run_dir at a "
                             f"folder on a filesystem with file locks (Lustre: mount with -o flock)") from None

    def _flock(self, wait_s: float) -> None:
        """flock without blocking; while another process holds it, retry once a second for up to
        `wait_s` (saying so once), then raise BlockingIOError."""
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise
                if not said:
                    print(f"waiting up to {wait_s:.0f} s for the lock on {self.path}: this restart's previous "
                          f"attempt may still hold it (a lost node's lock lasts until the file server's "
                          f"lease expires)", file=sys.stderr, flush=True)
                    said = True
                time.sleep(1.0)

    def _locks_the_current_file(self) -> bool:
        try:
            return os.fstat(self._fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Unlock. A folder that this launch created and left holding nothing but the lock file is
        removed again, so a refused launch leaves no trace."""
        try:
            if self._created and {p.name for p in self.run_dir.iterdir()} <= {LOCK_FILE}:
                if self._fd is not None:
                    self.path.unlink(missing_ok=True)
                for d in self._created:
                    d.rmdir()
        except OSError:
            pass  # something else appeared in the folder meanwhile: leave it
        self._created = []
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def lock_run_dir(run_dir: Path, rank: int, distributed: bool) -> RunLock:
    """Collective: global rank 0 takes the run folder's lock (a torchrun restart waits for it,
    restart_lock_wait); every rank raises the same UsageError when it cannot. Returns the lock
    (held on rank 0); release() it at the end of the launch."""
    lock = RunLock(run_dir)
    error = None
    if rank == 0:
        try:
            lock.acquire(wait_s=restart_lock_wait())
        except UsageError as e:
            error = str(e)
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        lock.release()
        raise UsageError(error)
    return lock
