"""Files of tensors written one tensor at a time: the writer holds one tensor's bytes, never the set.

`save_torch`: the file `torch.save(payload)` writes (a zip: `data.pkl`, then one record per
storage), written in two passes. `torch.serialization.skip_data` writes the whole layout first
from FakeTensors (shapes and dtypes, no storage): the pickle, every record's header and the zip's
directory, with the records' bytes left as holes. Then each tensor is asked for, written at its
record's offset and dropped. The records' CRC-32 (which skip_data leaves 0) is filled in last, in
each local header and in the central directory, so the zip checks as torch.save's does. The result
loads with `torch.load(..., weights_only=True)` and `mmap=True` like any torch.save file.

`save_safetensors`: the safetensors format (8-byte little-endian header length, the JSON header
with each tensor's dtype, shape and byte range, then the bytes), header first, then each tensor.
"""
from __future__ import annotations

import json
import os
import struct
import zipfile
import zlib
from typing import BinaryIO, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ReadTensor = Callable[[str], torch.Tensor]  # name -> the whole tensor, read (or gathered) when asked for
_CENTRAL = 0x02014B50  # a central directory entry's signature (PKWARE APPNOTE 4.3.12)
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def storage_owners(layout: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the first name of `layout` (meta tensors; tied names share a storage) whose tensor
    shares its storage: a tensor's owner is itself unless it is tied to an earlier one."""
    first: dict[int, str] = {}
    return {name: first.setdefault(t.untyped_storage()._cdata, name) for name, t in layout.items()}


def storage_order(layout: dict[str, torch.Tensor]) -> list[str]:
    """The names that own a storage, in the order torch.save numbers the storages (dict order)."""
    return list(dict.fromkeys(storage_owners(layout).values()))


def save_torch(f: BinaryIO, payload: dict, slot: str, layout: dict[str, torch.Tensor], read: ReadTensor) -> None:
    """Write torch.save({**payload, slot: tensors}) to the file `f` (opened 'wb+'), where the
    tensors have `layout`'s names, shapes, dtypes and sharing and each is `read(name)`, once per
    storage, in storage_order. `payload` holds plain data only (it is pickled before `slot`)."""
    owners = storage_owners(layout)
    order = list(dict.fromkeys(owners.values()))
    with FakeTensorMode():  # shapes and dtypes on the CPU device, no bytes
        fakes = {n: torch.empty(layout[n].shape, dtype=layout[n].dtype) for n in order}
    tensors = {name: fakes[owner] for name, owner in owners.items()}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({slot: tensors, **payload}, f)
    f.flush()
    records = _data_records(f, len(order))
    crcs = []
    for i, name in enumerate(order):
        crcs.append(_write_tensor(f.fileno(), records[i][1], read(name), layout[name]))
    _set_crcs(f, records, crcs)


def _data_records(f: BinaryIO, n: int) -> list[tuple[zipfile.ZipInfo, int]]:
    """(zip entry, offset of its bytes) of the storages data/0 .. data/n-1 that torch.save laid out."""
    f.seek(0)
    entries = {info.filename.split("/")[-1]: info for info in zipfile.ZipFile(f).infolist()
               if info.filename.split("/")[-2:-1] == ["data"]}  # <archive>/data/<key>
    f.seek(0)
    reader = torch._C.PyTorchFileReader(f)
    if sorted(entries) != sorted(str(i) for i in range(n)):
        raise RuntimeError(f"torch.save laid out {len(entries)} storages, {n} expected")
    return [(entries[str(i)], reader.get_record_offset(f"data/{i}")) for i in range(n)]


def _write_tensor(fd: int, offset: int, tensor: torch.Tensor, like: torch.Tensor) -> int:
    """Write `tensor`'s bytes at `offset` (checked against `like`'s shape and dtype); its CRC-32."""
    if tuple(tensor.shape) != tuple(like.shape) or tensor.dtype != like.dtype:
        raise RuntimeError(f"tensor of shape {tuple(tensor.shape)} {tensor.dtype} where the file has "
                           f"{tuple(like.shape)} {like.dtype}")
    data = memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    crc, done = zlib.crc32(data), 0
    while done < len(data):  # pwrite may write less than asked
        done += os.pwrite(fd, data[done:], offset + done)
    return crc


def _set_crcs(f: BinaryIO, records: list[tuple[zipfile.ZipInfo, int]], crcs: list[int]) -> None:
    """Fill in each record's CRC-32: at byte 14 of its local header, and at byte 16 of its central
    directory entry (APPNOTE 4.3.7 and 4.3.12); the directory is read, patched and written back."""
    fd = f.fileno()
    for (info, _), crc in zip(records, crcs):
        os.pwrite(fd, struct.pack("<I", crc), info.header_offset + 14)
    f.seek(0)
    z = zipfile.ZipFile(f)
    start, size = z.start_dir, sum(46 + len(i.orig_filename.encode()) + len(i.extra) + len(i.comment)
                                   for i in z.infolist())
    directory = bytearray(os.pread(fd, size, start))
    crc_of = {info.filename: crc for (info, _), crc in zip(records, crcs)}
    at = 0
    while at < size:
        signature, = struct.unpack_from("<I", directory, at)
        if signature != _CENTRAL:
            raise RuntimeError(f"no zip central directory entry at byte {start + at}")
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", directory, at + 28)
        name = bytes(directory[at + 46:at + 46 + name_len]).decode()
        if name in crc_of:
            struct.pack_into("<I", directory, at + 16, crc_of[name])
        at += 46 + name_len + extra_len + comment_len
    os.pwrite(fd, bytes(directory), start)


def save_safetensors(f: BinaryIO, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], read: ReadTensor,
                     metadata: dict[str, str]) -> None:
    """A safetensors file of the tensors `layout` names (name -> (shape, dtype)), each `read(name)`
    when its turn comes: the header (its byte ranges follow from the shapes), then the bytes."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, (shape, dtype) in layout.items():
        if dtype not in _SAFETENSORS_DTYPES:
            raise RuntimeError(f"{name}: dtype {dtype} is not written here")
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the bytes start 8-aligned, as safetensors' own writer pads
    f.write(struct.pack("<Q", len(text)) + text)
    start = f.tell()
    f.flush()
    for name, (shape, dtype) in layout.items():
        _write_tensor(f.fileno(), start + header[name]["data_offsets"][0], read(name),
                      torch.empty(shape, dtype=dtype, device="meta"))
