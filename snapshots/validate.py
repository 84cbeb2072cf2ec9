"""Whether a snapshot folder is one this version can trust: complete, undamaged, safe to read,
of this format; and the list of snapshot folders, newest first.

A snapshot is valid when its meta.json parses as this format's record, every file it lists has
its recorded size and sha256, and DCP's index passes the restricted unpickler
(snapshots/reader.py). Temporary folders (`.tmp-*`, a save in progress or one that failed) and
`damaged/` are never listed. snapshots/store.py decides what to do with the verdicts (resume,
skip, move aside, prune); export.py and sample.py read the same verdicts.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from snapshots.meta import FORMAT_VERSION, META, SnapshotMeta
from snapshots.reader import UnsafeSnapshot, read_dcp_metadata
from storage.files import sha256_file


def _other_format(meta) -> int | None:
    """The snapshot format recorded in meta.json when it is not this version's."""
    fmt = meta.get("format") if isinstance(meta, dict) else None
    ok = isinstance(fmt, int) and not isinstance(fmt, bool) and fmt != FORMAT_VERSION
    return fmt if ok else None


def other_format_refusal(path: Path) -> str | None:
    """The refusal line for a snapshot of another format (None for this format, or unreadable)."""
    try:
        fmt = _other_format(json.loads((path / META).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
    if fmt is None:
        return None
    which = "an older" if fmt < FORMAT_VERSION else "a newer"
    return (f"snapshot {path} has snapshot format {fmt}, written by {which} version of this project "
            f"(this one reads format {FORMAT_VERSION}, which unpickles nothing); resume or export it "
            f"with that version, or use another trainer.run_dir")


def validate_snapshot(path: Path) -> tuple[dict | None, str]:
    """(meta, "") for a complete, undamaged snapshot, else (None, reason). Hashes every file and
    reads the DCP index through the restricted unpickler."""
    meta_path = path / META
    if not meta_path.is_file():
        return None, "no meta.json (incomplete)"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, "meta.json is damaged"
    if (fmt := _other_format(meta)) is not None:
        return None, f"snapshot format {fmt}, not this version's {FORMAT_VERSION}"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "files" not in meta:
        return None, "meta.json is not a snapshot record of this version"
    missing = [f.name for f in dataclasses.fields(SnapshotMeta) if f.name not in meta
               and f.default is dataclasses.MISSING]
    if missing:
        return None, f"meta.json lacks {', '.join(missing)}"
    for name, rec in meta["files"].items():
        f = path / name
        if "/" in name or name in (".", "..") or not f.is_file():
            return None, f"missing file {name}"
        if f.stat().st_size != rec["size"]:
            return None, f"file {name} has the wrong size (truncated?)"
        if sha256_file(f) != rec["sha256"]:
            return None, f"file {name} fails its checksum"
    if ".metadata" not in meta["files"]:
        return None, "no DCP metadata"
    try:
        read_dcp_metadata(path, set(meta["files"]))
    except UnsafeSnapshot as e:
        return None, f"unsafe: {e}"
    return meta, ""


def list_snapshots(snap_dir: Path) -> list[Path]:
    """Complete snapshot folders, newest step first (temp folders are never listed)."""
    if not snap_dir.is_dir():
        return []
    found = []
    for p in snap_dir.iterdir():
        if p.is_dir() and p.name.startswith("step_"):
            try:
                found.append((int(p.name[5:]), p))
            except ValueError:
                continue
    return [p for _, p in sorted(found, reverse=True)]
