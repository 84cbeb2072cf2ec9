"""What a snapshot is on disk, and whether this version can trust one.

A snapshot is a folder `step_NNNNNNN/` (`step_dir_name`) holding DCP's files (the tensors) and
`meta.json` (`META`): the run's record (`SnapshotMeta`: the step, the resolved config, the model
shape and tokenizer, enough to rebuild the model without the config file, the data position and
the layout that wrote it), the non-tensor state (optimizer param groups, scaler state: `split_state`
puts the tensors to DCP and the rest to JSON; `merge_ranks` merges every rank's rest, since
pipeline stages hold different parameters; `put_rest` puts it back on load), and every file's size
and sha256.

Reading without unpickling anything a snapshot author chose: DCP's tensor files are read with
torch.load(weights_only=True), but its `.metadata` index is a pickle, and DCP's planner reads
non-tensor (BYTE_IO) entries with torch.load(weights_only=False), so a folder from elsewhere could
run code. `read_dcp_metadata` unpickles the index with an unpickler that admits only the classes of
DCP's Metadata (and checks every BUILD), and refuses an index that names non-tensor entries or
files outside the snapshot; `SafeReader` is the FileSystemReader that uses it and refuses BYTE_IO
reads. Both raise `UnsafeSnapshot`.

Validity (`validate_snapshot`): meta.json parses as this format's record, every file it lists has
its recorded size and sha256, and the index passes the reader above. Temporary folders (`.tmp-*`,
a save in progress or one that failed) and `damaged/` are never listed (`list_snapshots`, newest
first). snapshots/store.py decides what to do with the verdicts (resume, skip, move aside, prune);
export.py and sample.py read the same verdicts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import pickle
from dataclasses import dataclass, is_dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType

from storage.files import sha256_file

META = "meta.json"
# 2: only tensors in DCP, param groups in meta.json["nontensor_state"] (1 had pickled param groups)
FORMAT_VERSION = 2


@dataclass
class SnapshotMeta:
    """The run's record in a snapshot's meta.json: enough to resume it, to refuse a launch that
    would be another run (data stream, model shape), and to rebuild the model and tokenizer
    without the config file."""
    step: int
    config: dict  # the whole resolved config (Config.to_dict)
    model_config: dict  # GPTConfig as a dict
    tokenizer: dict  # the tokenizer record (char vocabulary or gpt2)
    fingerprint: str  # Config.model_fingerprint(): what fixes the parameter shapes
    data_position: dict  # {"step", **Trainer.data_stream()}: batches are a pure function of these
    world_size: int
    strategy: str  # parallel.strategy of the writer
    mesh: dict  # {"pp", "dp", "tp"} of the writer: its RNG streams belong to that layout
    scaler: dict | None = None  # fp16 grad scaler state
    tracker_run_id: str | None = None  # the wandb run a resume continues

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "SnapshotMeta":
        """From a validated meta.json (which also holds this module's own keys: files, format)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def split_state(tree):
    """(tensors, rest): the same nested dicts, one holding the tensor leaves (for DCP), the other
    every non-tensor subtree (for JSON), None where a side has nothing."""
    if torch.is_tensor(tree):
        return tree, None
    if isinstance(tree, dict):
        tensors, rest = {}, {}
        for k, v in tree.items():
            t, r = split_state(v)
            if t is not None:
                tensors[k] = t
            if r is not None:
                rest[k] = r
        return tensors or None, rest or None
    if isinstance(tree, (list, tuple)) and any(split_state(v)[0] is not None for v in tree):
        raise TypeError("tensors inside lists are not supported in snapshots; use dicts")
    return None, tree


def merge_ranks(a, b):
    """One record of every rank's non-tensor state: equal values stay; dicts merge per key,
    lists of dicts per element; lists that differ (e.g. the parameter names of each pipeline
    stage's param group) become their ordered union; other differences keep the lower rank's."""
    if a == b:
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        return {**b, **{k: merge_ranks(v, b[k]) if k in b else v for k, v in a.items()}}
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) == len(b) and all(isinstance(x, dict) for x in [*a, *b]):
            return type(a)(merge_ranks(x, y) for x, y in zip(a, b))
        return type(a)(list(a) + [x for x in b if x not in a])
    return a


def _like(value, template):
    """`value` as JSON gave it back, with tuples where the template (this run's own state) has
    them (AdamW's betas)."""
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: _like(v, template.get(k)) for k, v in value.items()}
    if isinstance(template, (list, tuple)) and isinstance(value, list):
        items = [_like(v, template[i] if i < len(template) else None) for i, v in enumerate(value)]
        return tuple(items) if isinstance(template, tuple) else items
    return value


def put_rest(state: dict, stored: dict, where: str = "") -> None:
    """Replace each non-tensor value of `state` (a template: this run's own state) in place with
    the snapshot's JSON record of it; KeyError names one that the snapshot lacks."""
    for k, v in state.items():
        if torch.is_tensor(v):
            continue
        if isinstance(v, dict) and split_state(v)[0] is not None:  # holds tensors: go deeper
            put_rest(v, stored.get(k, {}) if isinstance(stored, dict) else {}, f"{where}{k}.")
        elif isinstance(stored, dict) and k in stored:
            state[k] = _like(stored[k], v)
        else:
            raise KeyError(f"{where}{k}")


class UnsafeSnapshot(ValueError):
    """A snapshot whose DCP index is not plain DCP metadata over tensors."""


# What DCP's .metadata pickle may name (torch/distributed/checkpoint/metadata.py and filesystem.py
# of the installed torch): its Metadata dataclasses, the per-file _StorageInfo, torch.Size,
# dtypes, the layout helper, and the path StorageMeta records. Nothing callable beyond those.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}


# Objects whose state the pickle may set (BUILD): fresh instances of DCP's metadata dataclasses;
# never a class, function or enum member, which the C unpickler would let a pickle modify.
_BUILDABLE = frozenset([_StorageInfo] + [c for c in vars(dcp_metadata).values() if isinstance(c, type)
                                         and c.__module__ == dcp_metadata.__name__ and is_dataclass(c)])


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (stdlib), so that BUILD can be checked too."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__:
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:  # its own classes only
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED_GLOBALS:
            return _ALLOWED_GLOBALS[(module, name)]
        raise UnsafeSnapshot(f"its DCP .metadata names {module}.{name}, which DCP metadata never holds")

    def persistent_load(self, pid):
        raise UnsafeSnapshot("its DCP .metadata holds a persistent reference")

    def load_build(self):
        target = self.stack[-2]  # BUILD pops the state, then sets it on the object below it
        if type(target) not in _BUILDABLE:
            raise UnsafeSnapshot(f"its DCP .metadata sets the state of {type(target).__name__} "
                                 f"{str(target)[:60]!r}, which DCP metadata never does")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build


# Indexes already parsed and checked, by (path, inode, size, mtime): a resume reads one snapshot's
# index four times (validation, the stored-keys check, the load's own check and DCP's reader), and
# the restricted unpickler is pure Python (slow on the index of a large sharded model). A file
# changed since (a new inode, size or mtime) is parsed and checked again.
_PARSED: dict[tuple, dcp_metadata.Metadata] = {}
_PARSED_MAX = 4


def _parse_checked(path: Path) -> dcp_metadata.Metadata:
    try:
        st = os.stat(path / ".metadata")
        key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
        if key in _PARSED:
            return _PARSED[key]
        with open(path / ".metadata", "rb") as f:
            md = _MetadataUnpickler(f).load()
    except UnsafeSnapshot:
        raise
    except Exception as e:  # missing, truncated or garbage pickle
        raise UnsafeSnapshot(f"its DCP .metadata does not parse ({type(e).__name__})") from None
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise UnsafeSnapshot("its DCP .metadata is not a DCP Metadata record")
    for name, entry in md.state_dict_metadata.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise UnsafeSnapshot(f"its DCP entry {name!r} is not a tensor ({type(entry).__name__}); "
                                 f"snapshots of this format hold only tensors")
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise UnsafeSnapshot("its DCP .metadata has a malformed storage index")
    while len(_PARSED) >= _PARSED_MAX:
        _PARSED.pop(next(iter(_PARSED)))
    _PARSED[key] = md
    return md


def read_dcp_metadata(path: Path, files: set[str] | None = None) -> dcp_metadata.Metadata:
    """DCP's index of `path`, unpickled with only DCP's metadata classes admitted, and checked
    to describe tensors only (a BYTE_IO entry would be read with torch.load(weights_only=False))
    stored in the snapshot's own data files (`files`, when given). Raises UnsafeSnapshot. The
    result is shared by later calls for the same unchanged file: do not modify it."""
    md = _parse_checked(path)
    for info in md.storage_data.values():
        if files is not None and info.relative_path not in files:
            raise UnsafeSnapshot(f"its DCP .metadata points at {info.relative_path!r}, not a file "
                                 f"of the snapshot")
    return md


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader that reads .metadata with the restricted unpickler and refuses BYTE_IO
    reads (DCP's planner loads those with torch.load(weights_only=False)); tensors themselves are
    read with torch.load(weights_only=True) by FileSystemReader.read_data. read_metadata takes no
    `rank` keyword, so DCP never falls back to (unchecked) rank-local metadata files."""

    def read_metadata(self) -> dcp_metadata.Metadata:
        md = read_dcp_metadata(Path(self.path))
        # a copy with this load's id: the parsed index itself is shared (read_dcp_metadata)
        storage = dataclasses.replace(md.storage_meta or dcp_metadata.StorageMeta(), load_id=self.load_id)
        return dataclasses.replace(md, storage_meta=storage)

    def read_data(self, plan, planner):
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise UnsafeSnapshot("DCP was asked to unpickle a non-tensor entry")
        return super().read_data(plan, planner)


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
