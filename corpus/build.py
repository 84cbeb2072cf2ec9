"""The prepare library: text files in, a token corpus folder out (shards + corpus.json).

prepare.py is its command and documents the format and the algorithm: chunks cut at safe line
breaks, tokenized by a pool of worker processes, written in input order into shards; the
validation split is the last fraction of the input bytes; corpus.json is written last.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from config import UsageError
from corpus.kinds import SIDECAR
from corpus.token_files import (
    FORMAT,
    GPT2_VOCAB,
    VERSION,
    CorpusRecord,
    Shard,
    max_token,
    probe,
    read_record,
    smallest_dtype,
)
from corpus.tokenizers import CharTokenizer, GPT2Tokenizer
from storage.files import atomic_write_text, sha256_file

# A line break between two printable ASCII characters: every GPT-2 pre-token (tiktoken's r50k
# regex) either ends before it or is the "\n" itself, so text cut after it tokenizes the same.
SAFE_CUT = re.compile(rb"(?<=[!-~])\n(?=[!-~])")
WINDOW = 64 << 10  # bytes read at a time while looking for a cut
EOT = 50256  # GPT-2's <|endoftext|>
# The progress bar: on a terminal only (tqdm's disable=None), and cleared when it ends, so an error
# is the one line left on stderr.
BAR = {"file": sys.stderr, "disable": None, "leave": False}


@dataclass(frozen=True)
class Task:
    split: str  # train | val
    path: str
    start: int  # byte range [start, end) of the file
    end: int
    last_of_file: bool


# ----------------------------------------------------------------------------- planning


def list_inputs(inputs: list[str]) -> list[Path]:
    files = []
    for name in inputs:
        p = Path(name).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise UsageError(f"input folder {p} holds no files; give text files or folders of them")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise UsageError(f"input {p} does not exist; give text files or folders of them")
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise UsageError("every input is empty; give text to tokenize")
    return files


def next_cut(f, size: int, pos: int) -> int:
    """The first position >= pos right after a SAFE_CUT line break, or size."""
    start = max(pos - 2, 0)  # the look-behind byte of a "\n" at pos - 1
    while start < size:
        f.seek(start)
        window = f.read(WINDOW)
        m = SAFE_CUT.search(window, max(pos - 1 - start, 0))
        if m:
            return start + m.end()
        if start + len(window) >= size:
            break
        start += len(window) - 2  # overlap: a "\n" at the window's end needs its look-ahead byte
    return size


def plan(files: list[Path], chunk_bytes: int, val_fraction: float) -> list[Task]:
    """Chunks of every file, the ones from the val cut on marked val (see the module docstring)."""
    spans = []  # (path, start, end, global start)
    offset = 0
    for p in files:
        size = p.stat().st_size
        with open(p, "rb") as f:
            start = 0
            while start < size:
                end = next_cut(f, size, start + chunk_bytes)
                spans.append((p, start, end, offset + start))
                start = end
        offset += size
    total = offset
    if int(total * val_fraction) == 0:
        raise UsageError(f"--val-fraction {val_fraction} of {total} bytes leaves no validation text; raise it")
    target = total - int(total * val_fraction)
    i = next(i for i, s in enumerate(spans) if s[3] <= target < s[3] + s[2] - s[1])
    p, start, end, g = spans[i]
    with open(p, "rb") as f:
        cut = next_cut(f, end, target - g + start)
    if cut == start and i > 0:
        first_val = i  # the chunk starts at the target
    elif start < cut < end:  # split the chunk holding the target at the cut
        spans[i:i + 1] = [(p, start, cut, g), (p, cut, end, g + cut - start)]
        first_val = i + 1
    elif i + 1 < len(spans):
        first_val = i + 1  # no cut after the target in this chunk: its end is one
    elif i > 0:
        first_val = i
    else:
        raise UsageError(f"cannot split the input into train and val: it has no line break between two "
                         f"printable characters near its last {val_fraction:.0%}; give more text")
    return [Task("val" if k >= first_val else "train", str(p), s, e,
                 k + 1 == len(spans) or spans[k + 1][0] != p)
            for k, (p, s, e, _) in enumerate(spans)]


# ----------------------------------------------------------------------------- workers


_tok = None  # this worker's tokenizer (_tokenizer)


def _tokenizer(kind: str, chars: str | None):
    """This worker's tokenizer, built once per vocabulary (the pool serves both passes of char)."""
    global _tok
    if _tok is None or _tok.kind != kind or (kind == "char" and _tok.chars != chars):
        _tok = GPT2Tokenizer() if kind == "gpt2" else CharTokenizer(chars)
    return _tok


def _text(t: Task) -> str:
    with open(t.path, "rb") as f:
        f.seek(t.start)
        raw = f.read(t.end - t.start)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"input {t.path} is not UTF-8 text (byte {t.start + e.start}); convert it with "
                         f"iconv -t utf-8 or leave it out") from None


def _chars(job: tuple[Task, str, str | None]) -> str:
    return "".join(set(_text(job[0])))


def _encode(job: tuple[Task, str, str | None]) -> np.ndarray:
    t, kind, chars = job
    ids = _tokenizer(kind, chars).encode(_text(t)).numpy()
    if t.last_of_file and kind == "gpt2":
        ids = np.append(ids, EOT)
    return ids


class InProcess:
    """--workers 1: the tasks run in this process, with no pool to start (what Pool offers in_order)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def apply_async(self, fn, args: tuple):
        return Done(fn(*args))


@dataclass
class Done:
    value: object

    def get(self):
        return self.value


def in_order(pool, fn, tasks: list[Task], extra: tuple, window: int, bar: tqdm):
    """pool results of fn((task, *extra)) over tasks, in task order, with at most `window` in
    flight, so memory stays bounded whatever the corpus size (Pool.imap would queue them all)."""
    pending: deque = deque()
    for t in tasks:
        pending.append((t, pool.apply_async(fn, ((t, *extra),))))
        if len(pending) >= window:
            done, result = pending.popleft()
            yield result.get()
            bar.update(done.end - done.start)
    while pending:
        done, result = pending.popleft()
        yield result.get()
        bar.update(done.end - done.start)


# ----------------------------------------------------------------------------- writing


def _dtype_code(dtype: str) -> str:
    """Little-endian on every machine: what token_files reads."""
    return {"uint8": "u1", "uint16": "<u2", "uint32": "<u4"}[dtype]


class ShardWriter:
    """One split's shards: ids appended in order, a new file every `shard_tokens` ids."""

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.shards: list[Shard] = []
        self._file = None
        self._hash = None
        self._count = 0

    def write(self, ids: np.ndarray) -> None:
        """ids: already in the file dtype (_dtype_code)."""
        while ids.size:
            if self._file is None:
                name = f"{self.split}_{len(self.shards):06d}.bin"
                self._file, self._hash, self._count = open(self.out / name, "wb"), hashlib.sha256(), 0
            take = ids[: self.shard_tokens - self._count]
            data = take.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take.size
            ids = ids[take.size:]
            if self._count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        path = Path(self._file.name)
        self._file.close()
        self.shards.append(Shard(path.name, self._count, self._hash.hexdigest(), probe(path, self.dtype)[0]))
        self._file = None

    def close(self) -> list[Shard]:
        if self._file is not None:
            self._close_shard()
        return self.shards


def start_method() -> str:
    """fork where it is safe: a worker starts in milliseconds instead of re-importing torch (seconds
    each, as spawn does), and the workers run no torch op (tokenizers: tiktoken and numpy). Safe
    only on Linux (macOS: fork is unsafe there) and while this process runs no other thread: a
    thread that holds a lock at the fork (the allocator's, the import lock, a library's) leaves it
    held forever in the child, which then hangs. prepare.py's own process has none when the pool
    starts (the bars come after); a process that ran torch or gloo before (a test session) has
    some (measured: a test session's worker hung in a futex), and gets spawn."""
    one_thread = len(os.listdir("/proc/self/task")) == 1 if sys.platform == "linux" else False
    return "fork" if one_thread else "spawn"


def prepare(inputs: list[str], kind: str, out: Path, workers: int, val_fraction: float,
            chunk_bytes: int, shard_tokens: int) -> CorpusRecord:
    files = list_inputs(inputs)
    tasks = plan(files, chunk_bytes, val_fraction)
    total = sum(t.end - t.start for t in tasks)
    if kind == "gpt2":
        GPT2Tokenizer()  # the BPE ranks load here first: one clear error instead of one per worker
    with multiprocessing.get_context(start_method()).Pool(workers) if workers > 1 else InProcess() as pool:
        chars = None
        if kind == "char":
            with tqdm(total=total, unit="B", unit_scale=True, desc="vocabulary", **BAR) as bar:
                seen: set[str] = set()
                for part in in_order(pool, _chars, tasks, (kind, None), 2 * workers, bar):
                    seen.update(part)
            chars = "".join(sorted(seen))
        vocab = GPT2_VOCAB if kind == "gpt2" else len(chars)
        dtype = smallest_dtype(vocab)
        writers = {s: ShardWriter(out, s, dtype, shard_tokens) for s in ("train", "val")}
        stream, biggest = hashlib.sha256(), 0
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", **BAR) as bar:
            for task, ids in zip(tasks, in_order(pool, _encode, tasks, (kind, chars), 2 * workers, bar)):
                if ids.size:
                    ids = ids.astype(_dtype_code(dtype))
                    writers[task.split].write(ids)
                    stream.update(ids.tobytes())
                    biggest = max(biggest, int(ids.max()))
    train, val = writers["train"].close(), writers["val"].close()
    if not train or not val:
        raise UsageError(f"the {'train' if not train else 'val'} split holds no tokens; give more text or "
                         f"change --val-fraction")
    tok = {"kind": "gpt2", "encoding": "r50k_base"} if kind == "gpt2" else {"kind": "char", "chars": chars}
    rec = CorpusRecord(FORMAT, VERSION, tok, vocab, dtype, biggest, stream.hexdigest(), train, val,
                       val_fraction, [str(f) for f in files])
    atomic_write_text(out / SIDECAR, rec.to_json(), durable=True)  # last: a folder without it is unfinished
    return rec


def verify(folder: Path) -> CorpusRecord:
    """Re-hash and re-scan every shard against DIR/corpus.json (what a launch only probes)."""
    rec = read_record(folder / SIDECAR)
    stream = hashlib.sha256()
    for split in ("train", "val"):
        for s in getattr(rec, split):
            p = folder / s.file
            item = np.dtype(rec.dtype).itemsize
            if not p.is_file() or p.stat().st_size != s.tokens * item:
                raise UsageError(f"{p} is missing or not {s.tokens} tokens long; prepare the corpus again")
            if sha256_file(p) != s.sha256:
                raise UsageError(f"{p} does not match its sha256 in {SIDECAR}; prepare the corpus again")
            if max_token(p, rec.dtype)[0] > rec.max_token:
                raise UsageError(f"{p} holds an id above the max_token of {SIDECAR}; prepare the corpus again")
            with open(p, "rb") as f:
                while block := f.read(16 << 20):
                    stream.update(block)
    if stream.hexdigest() != rec.sha256:
        raise UsageError(f"the shards of {folder} do not hash to the sha256 of {SIDECAR}; prepare the corpus again")
    return rec
