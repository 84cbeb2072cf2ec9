"""Files written whole or not at all, and their content hashes.

`atomic_write` is the one way this project writes a file under its final name: the bytes go to a
temporary name in the same folder (unique per process, so two ranks writing the same cache never
share one), then `os.replace` swaps it in, so a reader sees the old file or the new one, never half
of one. With `durable=True` the data is fsynced before the swap and the folder after it, so the new
name survives a power loss too (snapshots' meta.json, model.pt, corpus records); caches and plots
skip that cost. A failed write removes its temporary file and leaves the old file as it was.
`append_whole` is the same rule for a file that grows by records (metrics.jsonl).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Callable

HASH_BLOCK = 1 << 20  # bytes read at a time while hashing


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where the filesystem cannot fsync a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None], durable: bool = False, mode: int | None = None) -> None:
    """Call `write(tmp)` to fill a temporary file, then put it at `path` in one rename. `mode`:
    the file's permission bits (default: what the writer left)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, durable: bool = False) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable=durable)


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path` whole or not at all: a write that fails midway (a full disk) is cut
    off again, so the file never ends in half a record (a JSON line a reader would choke on)."""
    with open(path, "ab", buffering=0) as f:
        start, view = f.tell(), memoryview(data)
        try:
            while view:
                view = view[f.write(view):]
        except OSError:
            with contextlib.suppress(OSError):
                f.truncate(start)
            raise


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in blocks (a corpus or a shard can be gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()
