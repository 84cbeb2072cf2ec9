"""Reading DCP snapshots without unpickling anything a snapshot author chose.

DCP's tensor data files are read with torch.load(weights_only=True), but its `.metadata` index is
a pickle, and DCP's planner reads non-tensor (BYTE_IO) entries with torch.load(weights_only=False):
a snapshot folder from elsewhere could run code. `read_dcp_metadata` unpickles the index with an
unpickler that admits only the classes of DCP's Metadata (and checks every BUILD), and refuses an
index that names non-tensor entries or files outside the snapshot; `SafeReader` is the
FileSystemReader that uses it and refuses BYTE_IO reads. Both raise `UnsafeSnapshot`.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
from dataclasses import is_dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType


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
