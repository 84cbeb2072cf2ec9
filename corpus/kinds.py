"""Which kind of corpus `data.path` names, decided from the path alone, and the rules of the `data`
keys that name files (`data_problems`). Imports nothing of the project that imports config.py:
config.py's validation reads it."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from config import REDACTED, DataConfig, has_redacted_credentials

SIDECAR = "corpus.json"  # the record prepare.py writes into a token corpus folder (corpus/token_files.py)


def token_corpus_kind(path: str) -> str:
    """What kind of pre-tokenized corpus data.path names (corpus/token_files.py reads both): "bin" for
    nanoGPT's raw uint16 train.bin, "folder" for prepare.py's output (a folder holding corpus.json,
    or that file), "" for text (a file or URL; corpus/text.py refuses any other folder)."""
    if path.startswith(("http://", "https://")):
        return ""
    if path.endswith(".bin"):
        return "bin"
    p = Path(path).expanduser()
    return "folder" if p.name == SIDECAR or (p / SIDECAR).is_file() else ""


def token_corpus_problems(d: DataConfig) -> Iterator[str]:
    """Keys that mean something only for a text corpus, or only for a nanoGPT .bin (a token
    corpus's split and length are fixed when it is prepared)."""
    kind = token_corpus_kind(d.path)
    if d.val_path and kind != "bin":
        yield (f"data.val_path only applies when data.path is nanoGPT's train.bin, not "
               f"'{d.path}'; remove it")
    if d.val_path and not d.val_path.endswith(".bin"):
        yield (f"data.val_path='{d.val_path}' must be nanoGPT's val.bin (raw uint16 ids, a .bin "
               f"file); fix it or leave it empty for the val.bin beside data.path")
    if kind == "bin" and d.tokenizer != "gpt2":
        yield (f"data.path '{d.path}' is a nanoGPT .bin, which holds GPT-2 ids (its char "
               f"vocabulary would be in meta.pkl, a pickle this project never reads): set "
               f"data.tokenizer=gpt2, or tokenize the text with python prepare.py --tokenizer char")
    if kind:
        if d.truncate:
            yield ("data.truncate counts characters of a text corpus, and data.path is a token "
                   "corpus; remove it (prepare a shorter corpus instead)")
        if d.val_fraction != type(d)().val_fraction:  # the default, without importing config at run time
            yield (f"data.val_fraction splits a text corpus; a token corpus's split is fixed by "
                   f"its files (prepare.py --val-fraction): remove data.val_fraction={d.val_fraction}")


def data_problems(d: DataConfig) -> Iterator[str]:
    """What is wrong with the keys that name the corpus and its cache, in the order a user meets them
    (config.py raises the first)."""
    if not d.path:
        yield "data.path is empty; give a text file or an http(s) URL"
        return
    if has_redacted_credentials(d.path):
        yield (f"data.path='{d.path}' holds redacted credentials ({REDACTED}), e.g. copied "
               f"from a run's config.yaml; pass the real URL: data.path=...")
    if d.sha256 and not (len(d.sha256) == 64 and all(c in "0123456789abcdefABCDEF" for c in d.sha256)):
        yield (f"data.sha256='{d.sha256[:70]}' is not a sha256 (64 hex digits); fix it or "
               f"set it to '' to skip the check")
    yield from token_corpus_problems(d)
    if not d.cache_dir:
        yield "data.cache_dir is empty; point it at a folder for downloaded corpora"
    elif d.path.startswith(("http://", "https://")):  # the cache is only read for a URL
        cache = Path(d.cache_dir).expanduser()
        try:
            if cache.exists() and not cache.is_dir():
                yield (f"data.cache_dir='{d.cache_dir}' is not a folder; point it at a folder for "
                       f"downloaded corpora")
        except OSError as e:  # e.g. another user's ~/.cache: exists() itself is refused
            yield (f"data.cache_dir='{d.cache_dir}' cannot be read ({e.strerror}); point it "
                   f"at a folder this user can write")
