"""Where a text corpus comes from: a local file, or an http(s) URL downloaded once into a cache
with a sha256 check, with a clearly announced offline fallback (the standard library's own text).

Every message names a URL with its credentials redacted (config.py, redact_url).
"""
from __future__ import annotations

import base64
import hashlib
import os
import sysconfig
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

from config import DataConfig, UsageError, redact_url
from storage.files import atomic_write, sha256_file

FALLBACK_CHARS = 2_000_000  # size of the offline fallback corpus
FALLBACK_SOURCE = "python-stdlib-fallback"  # load_corpus's description of it
# Where a run on the fallback corpus goes when trainer.run_dir was left at its default, so it never
# mixes with (or is sampled as) the default Shakespeare run.
FALLBACK_RUN_DIR = "runs/python_stdlib"


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
    """Download url to dest atomically (a failed or wrong download leaves no file) and check its hash."""
    def fetch(tmp: Path) -> None:
        with open(tmp, "wb") as f, urllib.request.urlopen(_request(url), timeout=20) as r:
            while chunk := r.read(1 << 20):
                f.write(chunk)
        got = sha256_file(tmp)
        if sha256 and got != sha256:
            raise UsageError(f"download of {redact_url(url)} has sha256 {got[:12]}..., expected "
                             f"{sha256[:12]}...; set data.sha256 to the right hash (or '' to skip the check)")

    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dest, fetch)


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
    the URL with its credentials redacted (config.py, redact_url). `fallback_run_dir`: the run folder
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
            if cfg.sha256 and sha256_file(cached) != cfg.sha256:
                raise UsageError(f"cached corpus {cached} does not match data.sha256; delete it to "
                                 f"download again")
            text, source = _read_text(cached, "cached corpus"), f"{shown} (cached at {cached})"
        elif cfg.offline_fallback:
            why = f": {type(error).__name__}" if error else ""
            if is_local_leader:
                into = f", into {fallback_run_dir}" if fallback_run_dir else ""
                warnings.warn(f"cannot download {shown}{why}; training on the Python standard "
                              f"library's source text instead{into}. To train on this corpus offline, put "
                              f"the file at {cached} (its sha256 is checked), or set data.path=FILE to a "
                              f"local file", stacklevel=2)
            text, source = fallback_corpus(), FALLBACK_SOURCE
        else:
            raise UsageError(f"cannot download {shown} and no cached copy exists; put the file "
                             f"at {cached} or set data.path to a local file")
    if cfg.truncate:
        text = text[: cfg.truncate]
    return text, source
