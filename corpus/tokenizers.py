"""The `char` and `gpt2` tokenizers, and the record of one a run folder and model.pt keep
(`to_dict` / `tokenizer_from_dict`), so a resume or a sample uses the vocabulary it was trained with.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tiktoken
import torch

from config import UsageError
from storage.files import atomic_write_text

TOKENIZER_FILE = "tokenizer.json"  # the run folder's tokenizer record


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
    atomic_write_text(path, json.dumps(tok.to_dict(), ensure_ascii=False), durable=True)


def load_tokenizer_record(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path} is damaged; delete it (and the run's snapshots) or use another "
                         f"trainer.run_dir") from None
