"""Pre-tokenized corpora read through numpy.memmap, never loaded whole.

Two formats (`data.path`):
- nanoGPT's `train.bin`: raw little-endian uint16 GPT-2 BPE ids, no header, as nanoGPT's
  data/*/prepare.py writes them; the val split is `val.bin` beside it, or `data.val_path`. Only
  `data.tokenizer=gpt2`: nanoGPT's char-level .bin keeps its vocabulary in meta.pkl, a pickle, which
  this project never reads (re-tokenize the text with `prepare.py --tokenizer char`).
- prepare.py's folder: token shards of each split plus `corpus.json` (`CorpusRecord`): the tokenizer
  (with the vocabulary for `char`), dtype, per-shard token counts and hashes, the largest token id,
  and the sha256 of all token bytes, which is the corpus identity a resume compares.

A split is a list of files read as one token stream (`TokenFiles`): a batch gathers its windows
through a numpy.memmap opened for that read and dropped after it (as nanoGPT does), so resident
memory holds the batch, not the corpus, however long the run.

What a launch checks, and what it costs (benchmarks/token_corpus.py on this project's 2-core CPU
machine, the file in the page cache: a chunked max over 1 GiB of uint16 0.05-0.3 s, its sha256
0.8-1.7 s; from a cold disk both take the disk's read time):
- every file: its size against the dtype and the recorded token count (a truncated shard);
- prepare.py's folder: the dtype holds the vocabulary, the sidecar's largest id is below it, and the
  `probe` of every shard (16 blocks of 64 KiB spread over it, the whole file when smaller: 1 MiB
  read per shard, however large) matches the sidecar, with no id there >= the vocabulary. The whole
  files were hashed and scanned once, when prepare.py wrote them: a launch trusts that record
  instead of re-hashing gigabytes. `python prepare.py --verify DIR` re-hashes everything.
- a nanoGPT .bin has no record: a chunked max over both files (a read of every byte, no hash) proves
  every id is a GPT-2 id, and its identity for a resume is the sha256 of the sizes and probes of
  both files (a replaced or re-tokenized file changes them; a few edited ids between probes do not).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from config import Config, UsageError
from corpus.kinds import SIDECAR, token_corpus_kind

FORMAT = "mingpt-parallel tokens"
VERSION = 1
DTYPES = ("uint8", "uint16", "uint32")
GPT2_VOCAB = 50257  # tiktoken r50k_base
PROBE_BLOCK = 64 << 10  # bytes per probe block
PROBE_BLOCKS = 16  # probe blocks per file
SCAN_BYTES = 4 << 20  # read size of a chunked max (its buffer is what the scan holds in memory)


# ----------------------------------------------------------------------------- the sidecar


@dataclass
class Shard:
    file: str  # name inside the corpus folder
    tokens: int
    sha256: str  # of the whole file (prepare.py --verify)
    probe_sha256: str  # of its probe blocks (checked at every launch)


@dataclass
class CorpusRecord:
    """corpus.json: written by prepare.py after its last shard, so a folder without it is unfinished."""
    format: str
    version: int
    tokenizer: dict  # char_dataset's tokenizer record: {"kind": "char", "chars": ...} or {"kind": "gpt2", ...}
    vocab_size: int
    dtype: str  # numpy dtype of every shard (little-endian)
    max_token: int  # largest id in all shards
    sha256: str  # of all token bytes: the train shards, then the val shards, in order
    train: list[Shard]
    val: list[Shard]
    val_fraction: float  # the last fraction of the input bytes went to val (prepare.py)
    sources: list[str]  # the input files, in the order read

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["train"] = [vars(s) for s in self.train]
        d["val"] = [vars(s) for s in self.val]
        return json.dumps(d, ensure_ascii=False, indent=1)


_HEX64 = re.compile(r"[0-9a-f]{64}")


def read_record(path: Path) -> CorpusRecord:
    """corpus.json as a CorpusRecord, every field type-checked (a damaged file: one line)."""
    def damaged(why: str) -> UsageError:
        return UsageError(f"{path} is damaged ({why}); prepare the corpus again with prepare.py")

    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise damaged("not JSON") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise damaged(f"format is not '{FORMAT}'")
    if d.get("version") != VERSION:
        raise UsageError(f"{path} has version {d.get('version')!r}; this code reads version {VERSION}: "
                         f"prepare the corpus again with this prepare.py")
    types = {"tokenizer": dict, "vocab_size": int, "dtype": str, "max_token": int, "sha256": str,
             "train": list, "val": list, "val_fraction": (int, float), "sources": list}
    for key, t in types.items():
        if not isinstance(d.get(key), t) or isinstance(d.get(key), bool):
            raise damaged(f"field '{key}' is missing or not a {getattr(t, '__name__', 'number')}")
    if not _HEX64.fullmatch(d["sha256"]):
        raise damaged("field 'sha256' is not a sha256")
    splits = {}
    for split in ("train", "val"):
        shards = []
        for s in d[split]:
            ok = isinstance(s, dict) and isinstance(s.get("file"), str) and "/" not in s["file"] \
                and isinstance(s.get("tokens"), int) and s["tokens"] > 0 \
                and all(isinstance(s.get(k), str) and _HEX64.fullmatch(s[k]) for k in ("sha256", "probe_sha256"))
            if not ok:
                raise damaged(f"an entry of '{split}' is not {{file, tokens > 0, sha256, probe_sha256}}")
            shards.append(Shard(s["file"], s["tokens"], s["sha256"], s["probe_sha256"]))
        if not shards:
            raise damaged(f"split '{split}' lists no shard")
        splits[split] = shards
    return CorpusRecord(FORMAT, VERSION, d["tokenizer"], d["vocab_size"], d["dtype"], d["max_token"],
                        d["sha256"], splits["train"], splits["val"], float(d["val_fraction"]),
                        [str(s) for s in d["sources"]])


def smallest_dtype(vocab_size: int) -> str:
    return next(t for t in DTYPES if vocab_size <= np.iinfo(t).max + 1)


# ----------------------------------------------------------------------------- cheap whole-file facts


def probe(path: Path, dtype: str) -> tuple[str, int]:
    """(sha256 of the size and PROBE_BLOCKS blocks spread over the file, largest id in them): what
    a launch reads of a file, 1 MiB however large it is (the whole file when smaller)."""
    size = path.stat().st_size
    item = np.dtype(dtype).itemsize
    h = hashlib.sha256(str(size).encode())
    biggest = 0
    with open(path, "rb") as f:
        if size <= PROBE_BLOCK * PROBE_BLOCKS:
            spans = [(0, size)]
        else:
            starts = np.linspace(0, size - PROBE_BLOCK, PROBE_BLOCKS).astype(np.int64) // item * item
            spans = [(int(s), PROBE_BLOCK) for s in starts]
        for start, length in spans:
            f.seek(start)
            block = f.read(length)
            h.update(block)
            ids = np.frombuffer(block, dtype=dtype, count=len(block) // item)
            if ids.size:
                biggest = max(biggest, int(ids.max()))
    return h.hexdigest(), biggest


def max_token(path: Path, dtype: str) -> tuple[int, int]:
    """(largest id in the file, its position), in SCAN_BYTES reads: a read, not a memmap, so the
    pages scanned never count in this process's resident memory."""
    item = np.dtype(dtype).itemsize
    buf = np.empty(SCAN_BYTES // item, dtype=dtype)
    biggest, where, pos = -1, 0, 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(memoryview(buf).cast("B")):
            ids = buf[: n // item]
            i = int(ids.argmax())
            if int(ids[i]) > biggest:
                biggest, where = int(ids[i]), pos + i
            pos += ids.size
    return biggest, where


# ----------------------------------------------------------------------------- reading


class TokenFiles:
    """One split: token files read in order as one stream, indexed like a 1-D int64 tensor
    (`files[idx]` with an integer tensor), through a numpy.memmap opened per read: mapped pages
    are dropped with it, so a long run's resident memory does not grow towards the corpus size
    (nanoGPT re-opens its memmap every batch for the same reason)."""

    def __init__(self, paths: list[Path], counts: list[int], dtype: str):
        self.paths, self.counts, self.dtype = paths, counts, dtype
        self.bounds = np.cumsum([0, *counts])

    def numel(self) -> int:
        return int(self.bounds[-1])

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        flat = idx.reshape(-1).numpy()
        out = np.empty(flat.shape, dtype=np.int64)
        shard = np.searchsorted(self.bounds, flat, side="right") - 1
        for s in np.unique(shard):
            here = shard == s
            mm = np.memmap(self.paths[s], dtype=self.dtype, mode="r", shape=(self.counts[s],))
            out[here] = mm[flat[here] - self.bounds[s]]
            del mm  # unmap now
        return torch.from_numpy(out).reshape(idx.shape)


@dataclass
class TokenCorpus:
    train: TokenFiles
    val: TokenFiles
    tokenizer: dict  # the tokenizer record the ids belong to
    digest: str  # the corpus identity a resume compares (Trainer.data_stream's corpus_sha256)
    description: str  # for the start-up view


def _sized(path: Path, dtype: str, tokens: int | None, what: str) -> int:
    """The file's token count; refuses a missing file or a size that is not `tokens` ids."""
    if not path.is_file():
        raise UsageError(f"{what} {path} does not exist; prepare the corpus again with prepare.py")
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size % item:
        raise UsageError(f"{what} {path} is truncated: {size} bytes is not a whole number of {dtype} "
                         f"ids ({item} bytes each); copy or prepare it again")
    if tokens is not None and size != tokens * item:
        raise UsageError(f"{what} {path} holds {size // item} tokens but {SIDECAR} says {tokens}: the shard "
                         f"is truncated or not the one prepared; copy or prepare the corpus again")
    return size // item


def corpus_tokenizer(corpus: TokenCorpus, stored: dict | None) -> dict:
    """The tokenizer record of a run on `corpus`: the corpus's own, since its ids are fixed on disk.
    A record the run already has (its folder's tokenizer.json, or model.init_from's) must be the
    same; one of another kind is left to char_dataset.build_tokenizer, which names both kinds."""
    if stored is None or stored.get("kind") != corpus.tokenizer.get("kind"):
        return stored if stored is not None else corpus.tokenizer
    if stored != corpus.tokenizer:
        raise UsageError(f"{corpus.description.split(' (')[0]} was prepared with another character vocabulary "
                         f"than this run's (its tokenizer.json, or model.init_from's): its ids would mean other "
                         f"characters; use another trainer.run_dir (or the corpus the run was trained on)")
    return stored


def adopt_corpus_tokenizer(cfg: Config, explicit: set[str]) -> None:
    """data.tokenizer from a token corpus, whose ids fix it, when the user did not set the key (on the
    command line or in a --config file): prepare.py's corpus.json names it, a nanoGPT .bin holds GPT-2
    ids. load_config's `adopt`, as model.init_from's shape is adopted (weights/pretrained.py); the
    corpus comes after init_from, so a model of another vocabulary is refused when the corpus opens."""
    kind = token_corpus_kind(cfg.data.path)
    if "data.tokenizer" in explicit or not kind:
        return
    if kind == "bin":
        cfg.data.tokenizer = "gpt2"
        return
    path = Path(cfg.data.path).expanduser()
    sidecar = path if path.name == SIDECAR else path / SIDECAR
    if sidecar.is_file() and read_record(sidecar).tokenizer.get("kind") in ("char", "gpt2"):
        cfg.data.tokenizer = read_record(sidecar).tokenizer["kind"]


def open_token_corpus(path_text: str, tokenizer_kind: str, val_path: str = "") -> TokenCorpus:
    """Open and check a token corpus (data.path of a kind config.token_corpus_kind names)."""
    path = Path(path_text).expanduser()
    if token_corpus_kind(path_text) == "bin":
        return _open_bin(path, Path(val_path).expanduser() if val_path else path.parent / "val.bin",
                         bool(val_path))
    return _open_folder(path.parent if path.name == SIDECAR else path, tokenizer_kind)


def _open_bin(train: Path, val: Path, val_named: bool) -> TokenCorpus:
    if not train.is_file():
        raise UsageError(f"data.path {train} does not exist; give nanoGPT's train.bin or a folder "
                         f"written by prepare.py")
    if not val.is_file():
        fix = "fix data.val_path" if val_named else "put nanoGPT's val.bin there or name it with data.val_path=..."
        raise UsageError(f"no val file for {train}: {val} does not exist; {fix}")
    parts, ident = [], hashlib.sha256(b"nanogpt-bin uint16")
    for p in (train, val):
        n = _sized(p, "uint16", None, "token file")
        if n == 0:
            raise UsageError(f"token file {p} is empty; give a prepared train.bin and val.bin")
        biggest, where = max_token(p, "uint16")
        if biggest >= GPT2_VOCAB:
            raise UsageError(f"token file {p} holds id {biggest} at token {where}, not a GPT-2 id (< {GPT2_VOCAB}): "
                             f"a .bin must be nanoGPT's uint16 GPT-2 BPE ids; tokenize the text with prepare.py")
        ident.update(probe(p, "uint16")[0].encode())
        parts.append(TokenFiles([p], [n], "uint16"))
    return TokenCorpus(parts[0], parts[1], {"kind": "gpt2", "encoding": "r50k_base"}, ident.hexdigest(),
                       f"{train} + {val} (nanoGPT uint16 GPT-2 ids)")


def _open_folder(folder: Path, tokenizer_kind: str) -> TokenCorpus:
    sidecar = folder / SIDECAR
    if not sidecar.is_file():
        raise UsageError(f"{sidecar} does not exist (prepare.py writes it last: an unfinished folder has "
                         f"none); set data.path to a folder written by prepare.py")
    rec = read_record(sidecar)
    if rec.dtype not in DTYPES:
        raise UsageError(f"{sidecar} names dtype '{rec.dtype}', not one of {', '.join(DTYPES)}; prepare the "
                         f"corpus again with prepare.py")
    kind = rec.tokenizer.get("kind")
    if kind != tokenizer_kind:
        raise UsageError(f"{folder} was prepared with --tokenizer {kind} but data.tokenizer={tokenizer_kind}; "
                         f"set data.tokenizer={kind}")
    if kind == "char":
        chars = rec.tokenizer.get("chars")
        if not isinstance(chars, str) or len(set(chars)) != len(chars) or len(chars) != rec.vocab_size:
            raise UsageError(f"{sidecar}: vocab_size {rec.vocab_size} is not the number of distinct "
                             f"characters of its 'chars'; prepare the corpus again with prepare.py")
    elif rec.vocab_size != GPT2_VOCAB:
        raise UsageError(f"{sidecar}: vocab_size {rec.vocab_size} is not GPT-2's {GPT2_VOCAB}; prepare the "
                         f"corpus again with prepare.py")
    room = int(np.iinfo(rec.dtype).max) + 1
    if rec.vocab_size > room:
        raise UsageError(f"{sidecar}: dtype {rec.dtype} holds ids below {room}, fewer than the vocabulary of "
                         f"{rec.vocab_size}; prepare the corpus again with prepare.py (it picks "
                         f"{smallest_dtype(rec.vocab_size)})")
    if rec.max_token >= rec.vocab_size:
        raise UsageError(f"{sidecar} records token id {rec.max_token}, not below the vocabulary of "
                         f"{rec.vocab_size}; prepare the corpus again with prepare.py")
    splits = {}
    for split in ("train", "val"):
        paths = []
        for s in getattr(rec, split):
            p = folder / s.file
            _sized(p, rec.dtype, s.tokens, f"{split} shard")
            digest, biggest = probe(p, rec.dtype)
            if digest != s.probe_sha256:
                raise UsageError(f"{split} shard {p} does not match {SIDECAR} (its content changed, or the "
                                 f"sidecar belongs to other shards); prepare the corpus again with prepare.py")
            if biggest >= rec.vocab_size:
                raise UsageError(f"{split} shard {p} holds token id {biggest}, not below the vocabulary of "
                                 f"{rec.vocab_size}; prepare the corpus again with prepare.py")
            paths.append(p)
        splits[split] = TokenFiles(paths, [s.tokens for s in getattr(rec, split)], rec.dtype)
    shards = f"{len(rec.train)} train + {len(rec.val)} val shards"
    return TokenCorpus(splits["train"], splits["val"], rec.tokenizer, rec.sha256,
                       f"{folder} ({shards}, {rec.dtype}, prepared by prepare.py)")
