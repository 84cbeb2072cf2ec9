"""Corpus, tokenizers and the batches every rank trains on.

Owns: reading the corpus (local file or http(s) URL downloaded once into a cache with a sha256
check, with a clearly announced offline fallback), the `char` and `gpt2` tokenizers, the
contiguous train/val split, and the order of training windows (over a text's tokens in memory, or
over token files on disk: token_files.py).

The order of training windows is a pure function of (seed, step): step s of epoch e reads windows
perm_e[k*B:(k+1)*B] of a per-epoch permutation, shifted by a per-epoch offset, where B is the
GLOBAL batch. A data-parallel rank takes rows [r*B/dp, (r+1)*B/dp) of that batch, so the global
batch of a step is identical whatever the world size, and a resume needs nothing but the step.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import sysconfig
import tempfile
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken
import torch

from config import DataConfig, UsageError, redact_url

FALLBACK_CHARS = 2_000_000  # size of the offline fallback corpus
FALLBACK_SOURCE = "python-stdlib-fallback"  # load_corpus's description of it
# Where a run on the fallback corpus goes when trainer.run_dir was left at its default, so it never
# mixes with (or is sampled as) the default Shakespeare run.
FALLBACK_RUN_DIR = "runs/python_stdlib"


# ----------------------------------------------------------------------------- corpus


def _read_text(path: Path, what: str) -> str:
    if path.is_dir():
        raise UsageError(f"{what} '{path}' is a folder without corpus.json; set data.path to a text file, "
                         f"nanoGPT's train.bin or a folder written by prepare.py")
    if not path.is_file():
        raise UsageError(f"{what} '{path}' does not exist; set data.path to an existing text file or URL")
    raw = path.read_bytes()
    if not raw.strip():
        raise UsageError(f"{what} '{path}' is empty; set data.path to a non-empty text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} '{path}' is not UTF-8 text (byte {e.start}); "
                         f"convert it with iconv -t utf-8 or pick another file") from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _request(url: str) -> urllib.request.Request:
    """urllib does not take user:password@ in a URL (it would look the whole netloc up as a host
    name): send it as HTTP basic auth instead."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return urllib.request.Request(url)
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    creds = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()
    return urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=host)),
                                  headers={"Authorization": "Basic " + base64.b64encode(creds).decode()})


def _download(url: str, dest: Path, sha256: str) -> None:
    """Download url to dest atomically (temp file + rename) and check its hash."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".part")
    try:
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(_request(url), timeout=20) as r:
            while chunk := r.read(1 << 20):
                f.write(chunk)
        got = _sha256(Path(tmp))
        if sha256 and got != sha256:
            raise UsageError(f"download of {redact_url(url)} has sha256 {got[:12]}..., expected "
                             f"{sha256[:12]}...; set data.sha256 to the right hash (or '' to skip the check)")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fallback_corpus() -> str:
    """Text that exists on every machine with Python: the standard library's own .py files,
    in a fixed order, so an offline run is still deterministic."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for p in sorted(root.glob("*.py")):
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(t)
        size += len(t)
        if size >= FALLBACK_CHARS:
            break
    return "".join(parts)[:FALLBACK_CHARS]


def corpus_cache_path(cfg: DataConfig) -> Path:
    # the name from the URL's path only: its query may hold a token
    name = urllib.parse.urlsplit(cfg.path).path.rstrip("/").rsplit("/", 1)[-1] or "corpus.txt"
    key = hashlib.sha256(cfg.path.encode()).hexdigest()[:8]
    return Path(os.path.expanduser(cfg.cache_dir)) / f"{key}-{name}"


def load_corpus(cfg: DataConfig, is_local_leader: bool = True, barrier=lambda: None,
                fallback_run_dir: str = "") -> tuple[str, str]:
    """Returns (text, description). For a URL, the local leader downloads while the others wait
    at `barrier`, then everyone reads the cached file. The description and every message name
    the URL with its credentials redacted (config.redact_url). `fallback_run_dir`: the run folder
    a fallback run goes to, named in the warning."""
    shown = redact_url(cfg.path)
    if not cfg.path.startswith(("http://", "https://")):
        text, source = _read_text(Path(cfg.path).expanduser(), "data file"), shown
    else:
        cached = corpus_cache_path(cfg)
        error = None
        if is_local_leader and not cached.is_file():
            try:
                _download(cfg.path, cached, cfg.sha256)
            except UsageError:
                raise
            except Exception as e:  # offline, DNS, HTTP error: decided below, same on every rank
                error = e
        barrier()
        if cached.is_file():
            if cfg.sha256 and _sha256(cached) != cfg.sha256:
                raise UsageError(f"cached corpus {cached} does not match data.sha256; delete it to "
                                 f"download again")
            text, source = _read_text(cached, "cached corpus"), f"{shown} (cached at {cached})"
        elif cfg.offline_fallback:
            why = f": {type(error).__name__}" if error else ""
            if is_local_leader:
                into = f", into {fallback_run_dir}" if fallback_run_dir else ""
                warnings.warn(f"cannot download {shown}{why}; training on the Python standard "
                              f"library's source text instead{into} (set data.path to a local file to "
                              f"choose the corpus)", stacklevel=2)
            text, source = fallback_corpus(), FALLBACK_SOURCE
        else:
            raise UsageError(f"cannot download {shown} and no cached copy exists; put the file "
                             f"at {cached} or set data.path to a local file")
    if cfg.truncate:
        text = text[: cfg.truncate]
    return text, source


# ----------------------------------------------------------------------------- tokenizers


class CharTokenizer:
    """One token per Unicode character; the vocabulary is the sorted set of corpus characters."""

    kind = "char"

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        codes = np.frombuffer(chars.encode("utf-32-le"), dtype=np.uint32)
        self._lut = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
        self._lut[codes] = np.arange(len(chars))

    @classmethod
    def from_corpus(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> torch.Tensor:
        # Vectorised: code points via UTF-32, then one table lookup (no per-character Python loop).
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        if codes.size and codes.max() >= len(self._lut):
            bad = chr(int(codes[codes >= len(self._lut)][0]))
            raise UsageError(f"character {bad!r} is not in this run's vocabulary; use only "
                             f"characters of the training corpus")
        ids = self._lut[codes]
        if (ids < 0).any():
            bad = chr(int(codes[ids < 0][0]))
            raise UsageError(f"character {bad!r} is not in this run's vocabulary; use only "
                             f"characters of the training corpus")
        return torch.from_numpy(ids)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": "char", "chars": self.chars}


class GPT2Tokenizer:
    """GPT-2 BPE (tiktoken's r50k_base, 50257 tokens). Offline use: TIKTOKEN_CACHE_DIR."""

    kind = "gpt2"

    def __init__(self):
        try:
            self._enc = tiktoken.get_encoding("r50k_base")
        except Exception as e:
            raise UsageError(f"cannot load the GPT-2 BPE ranks ({type(e).__name__}); go online once or "
                             f"set TIKTOKEN_CACHE_DIR to a folder holding them") from None
        self.vocab_size = self._enc.n_vocab

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self._enc.encode_ordinary(text), dtype=torch.int64)

    def decode(self, ids) -> str:
        return self._enc.decode(list(ids))

    def to_dict(self) -> dict:
        return {"kind": "gpt2", "encoding": "r50k_base"}


def tokenizer_from_dict(d: dict):
    if d.get("kind") == "char":
        return CharTokenizer(d["chars"])
    if d.get("kind") == "gpt2":
        return GPT2Tokenizer()
    raise UsageError(f"unknown tokenizer record {d.get('kind')!r}; the run folder is damaged")


def build_tokenizer(kind: str, text: str, stored: dict | None = None):
    """A stored tokenizer (from the run folder) wins, so resume and sampling use the same mapping."""
    if stored is not None:
        tok = tokenizer_from_dict(stored)
        if tok.kind != kind:
            raise UsageError(f"this run was trained with data.tokenizer={tok.kind}, not {kind}; "
                             f"use the same tokenizer or another trainer.run_dir")
        return tok
    return CharTokenizer.from_corpus(text) if kind == "char" else GPT2Tokenizer()


def save_tokenizer(tok, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(tok.to_dict(), ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def load_tokenizer_record(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path} is damaged; delete it (and the run's snapshots) or use another "
                         f"trainer.run_dir") from None


# ----------------------------------------------------------------------------- batches


@dataclass
class Batching:
    global_batch: int  # sequences per optimizer step, all dp ranks together
    dp_rank: int = 0
    dp_size: int = 1


class TokenDataset:
    """Batches over a train and a val split of token ids: 1-D int64 tensors (CharDataset), or
    token_files.TokenFiles, which read windows from files on disk through numpy.memmap. Both are
    indexed the same way (`split[int tensor]`), so the batch order below is the same code for both."""

    def __init__(self, train, val, block_size: int, seed: int, digest: str | None = None):
        self.block_size = block_size
        self.seed = seed
        self.train, self.val = train, val
        need = block_size + 1
        if train.numel() < 2 * need or val.numel() < need:
            raise UsageError(f"corpus has {train.numel()} train and {val.numel()} val tokens: too short for "
                             f"model.block_size={block_size} (train needs >= {2 * need}, val >= {need}); use a "
                             f"longer corpus, a smaller block_size or a larger validation split")
        # Non-overlapping windows with room for a shift in [0, T) and the +1 target.
        self.n_windows = (train.numel() - 1 - (block_size - 1)) // block_size
        self._perm_cache: tuple[int, torch.Tensor, int] | None = None
        self._arange = torch.arange(block_size + 1)
        self._digest = digest

    @property
    def digest(self) -> str:
        """The corpus identity a resume compares: given (a token corpus's recorded hash), or the sha256
        of the whole token stream (train + val), so a resume can tell whether the text under
        data.path changed (its path may change freely)."""
        if self._digest is None:
            h = hashlib.sha256()
            for part in (self.train, self.val):
                h.update(part.to(torch.int64).numpy().tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def steps_per_epoch(self, global_batch: int) -> int:
        return self.n_windows // global_batch

    def check_batch(self, global_batch: int) -> None:
        if self.steps_per_epoch(global_batch) < 1:
            raise UsageError(f"the train split holds {self.n_windows} windows of block_size "
                             f"{self.block_size}, fewer than trainer.batch_size={global_batch}; use a "
                             f"longer corpus or a smaller batch")

    def _epoch(self, epoch: int) -> tuple[torch.Tensor, int]:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            # int32 where it fits: the same permutation (randperm draws the same) in half the memory,
            # the one per-epoch cost that grows with the corpus (4 bytes per window)
            dtype = torch.int32 if self.n_windows < 2**31 else torch.int64
            perm = torch.randperm(self.n_windows, generator=g, dtype=dtype)
            shift = int(torch.randint(0, self.block_size, (1,), generator=g))
            self._perm_cache = (epoch, perm, shift)
        return self._perm_cache[1], self._perm_cache[2]

    def train_starts(self, step: int, global_batch: int) -> torch.Tensor:
        """Start offsets of the global batch of `step` (length global_batch)."""
        spe = self.steps_per_epoch(global_batch)
        epoch, k = divmod(step, spe)
        perm, shift = self._epoch(epoch)
        return shift + perm[k * global_batch:(k + 1) * global_batch].long() * self.block_size

    def _windows(self, data, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = data[starts[:, None] + self._arange]  # (B, T+1) in one gather
        return w[:, :-1], w[:, 1:]

    def train_batch(self, step: int, b: Batching) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's share of the global batch of `step`: (B/dp, T) inputs and targets."""
        starts = self.train_starts(step, b.global_batch)
        per = b.global_batch // b.dp_size
        return self._windows(self.train, starts[b.dp_rank * per:(b.dp_rank + 1) * per])

    def val_batches(self, n_batches: int, b: Batching):
        """Fixed validation batches (same every eval, every rank, every restart): windows evenly
        spaced over the val split; each dp rank evaluates its share of each batch."""
        total = n_batches * b.global_batch
        last = self.val.numel() - self.block_size - 1
        starts = torch.linspace(0, last, total).long()
        per = b.global_batch // b.dp_size
        for i in range(n_batches):
            s = starts[i * b.global_batch:(i + 1) * b.global_batch]
            yield self._windows(self.val, s[b.dp_rank * per:(b.dp_rank + 1) * per])


class CharDataset(TokenDataset):
    """A token stream in memory (an encoded text), split contiguously: train = first
    (1 - val_fraction), val = the rest. No window crosses the split, so no validation token is ever
    trained on."""

    def __init__(self, tokens: torch.Tensor, block_size: int, val_fraction: float, seed: int):
        n_val = int(tokens.numel() * val_fraction)
        n = tokens.numel()
        super().__init__(tokens[: n - n_val].contiguous(), tokens[n - n_val:].contiguous(), block_size, seed)
