"""char_dataset.py: tokenizers, the contiguous split, the batch order as a pure
function of (seed, step) whatever the world size, epochs, truncation, and the corpus download
(local http.server on 127.0.0.1 only: no test contacts a real host)."""
from __future__ import annotations

import functools
import hashlib
import http.server
import socket
import threading
import warnings

import pytest
import torch

from char_dataset import Batching, CharDataset
from config import DataConfig, UsageError
from corpus.text import corpus_cache_path, fallback_corpus, load_corpus
from corpus.tokenizers import CharTokenizer, GPT2Tokenizer
from testing.local import TINY, python

# ----------------------------------------------------------------------------- tokenizers


def test_char_tokenizer_round_trip_and_vectorised_encode(corpus):
    text = corpus.read_text(encoding="utf-8")
    tok = CharTokenizer.from_corpus(text)
    assert tok.vocab_size == 65 and tok.chars == "".join(sorted(set(text)))
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),)
    stoi = {c: i for i, c in enumerate(tok.chars)}
    assert ids[:5000].tolist() == [stoi[c] for c in text[:5000]]  # the per-character definition
    assert tok.decode(ids.tolist()) == text
    # code points beyond one byte and beyond the BMP; the vocabulary travels with the run
    odd = "naïve — ½ 😀 ROMEO:"
    tok2 = CharTokenizer.from_corpus(odd)
    assert tok2.decode(tok2.encode(odd).tolist()) == odd
    assert CharTokenizer(**{"chars": tok2.to_dict()["chars"]}).encode(odd).tolist() == tok2.encode(odd).tolist()
    with pytest.raises(UsageError, match="not in this run's vocabulary"):
        tok.encode("ROMEO 😀")


def test_gpt2_tokenizer_offline_round_trip():
    tok = GPT2Tokenizer()  # conftest points TIKTOKEN_CACHE_DIR at ../shared/data/tiktoken
    assert tok.vocab_size == 50257
    assert tok.encode("Hello world").tolist() == [15496, 995]  # GPT-2 BPE ids
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?  <|endoftext|> ½"
    assert tok.decode(tok.encode(text).tolist()) == text  # special tokens stay ordinary text


# ----------------------------------------------------------------------------- split and batches


def positions(n: int = 5000, block: int = 8, val_fraction: float = 0.1, seed: int = 3) -> CharDataset:
    """A dataset whose token at position i is i, so every window shows where it came from."""
    return CharDataset(torch.arange(n), block, val_fraction, seed)


def test_split_is_contiguous_and_no_window_crosses_it():
    d = positions()
    n_train = d.train.numel()
    assert n_train == 4500 and torch.equal(torch.cat([d.train, d.val]), torch.arange(5000))
    b = Batching(global_batch=16)
    for step in range(3 * d.steps_per_epoch(16)):  # three epochs: every shift and permutation
        x, y = d.train_batch(step, b)
        assert torch.equal(y, x + 1) and torch.equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows
        assert int(y.max()) < n_train, f"step {step} reads validation tokens"
    for x, y in d.val_batches(4, b):
        assert int(x.min()) >= n_train and torch.equal(y, x + 1)


def test_batches_are_a_pure_function_of_seed_and_step():
    a, b = positions(seed=3), positions(seed=3)
    one = Batching(global_batch=8)
    later_first = [b.train_batch(s, one)[0] for s in (700, 3, 0)]  # another order, another epoch
    for s, got in zip((700, 3, 0), later_first):
        assert torch.equal(a.train_batch(s, one)[0], got)
    assert not torch.equal(positions(seed=4).train_batch(3, one)[0], a.train_batch(3, one)[0])
    assert not torch.equal(a.train_batch(4, one)[0], a.train_batch(3, one)[0])


@pytest.mark.parametrize("dp", [2, 4, 8, 16])
def test_global_batch_is_the_same_for_any_dp_size(dp):
    """The default global batch, 16, split over 2-16 data-parallel ranks (16: one row each)."""
    d = positions()
    for step in (0, 1, 57, 123):
        whole_x, whole_y = d.train_batch(step, Batching(global_batch=16))
        shares = [d.train_batch(step, Batching(global_batch=16, dp_rank=r, dp_size=dp)) for r in range(dp)]
        assert all(x.shape == (16 // dp, 8) for x, _ in shares)
        assert torch.equal(torch.cat([x for x, _ in shares]), whole_x)
        assert torch.equal(torch.cat([y for _, y in shares]), whole_y)
    whole_val = list(d.val_batches(3, Batching(global_batch=16)))
    for i, batch in enumerate(zip(*[d.val_batches(3, Batching(16, r, dp)) for r in range(dp)])):
        assert torch.equal(torch.cat([x for x, _ in batch]), whole_val[i][0])


def test_an_epoch_reads_every_window_once():
    d = positions(n=5700, block=8)  # train split 5130 tokens: 640 windows = 40 steps of 16
    assert d.n_windows == 640 and d.steps_per_epoch(16) == 40
    b = Batching(global_batch=16)
    for epoch in range(2):
        starts = torch.cat([d.train_batch(s, b)[0][:, 0] for s in range(40 * epoch, 40 * (epoch + 1))])
        shift = int(starts.min()) % 8
        assert torch.equal(torch.sort(starts).values, shift + 8 * torch.arange(640)), epoch


def test_too_short_corpus_is_a_usage_error():
    with pytest.raises(UsageError, match="too short for model.block_size=64"):
        CharDataset(torch.arange(100), 64, 0.1, 0)
    d = positions(n=200, block=8)
    with pytest.raises(UsageError, match="fewer than trainer.batch_size"):
        d.check_batch(1000)


def test_truncate_keeps_a_prefix(corpus):
    text, source = load_corpus(DataConfig(path=str(corpus), truncate=1234))
    assert text == corpus.read_text(encoding="utf-8")[:1234] and source == str(corpus)


# ----------------------------------------------------------------------------- URL download


@pytest.fixture
def http_dir(tmp_path):
    """Serve tmp_path/www on 127.0.0.1; yields (folder, base_url, stop)."""
    www = tmp_path / "www"
    www.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(www)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stopped = []

    def stop() -> None:
        if not stopped:
            server.shutdown()
            server.server_close()
            stopped.append(True)

    yield www, f"http://127.0.0.1:{server.server_address[1]}", stop
    stop()


HELD_PORTS: list[socket.socket] = []


def closed_port() -> int:
    """A port where connections are refused at once, for as long as this process lives: bound and
    never listening (a port closed again could be taken by another process that listens)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    HELD_PORTS.append(s)
    return s.getsockname()[1]


def test_download_checks_sha256_and_is_cached(http_dir, tmp_path):
    www, base, stop = http_dir
    body = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50
    (www / "corpus.txt").write_text(body, encoding="utf-8")
    good = hashlib.sha256(body.encode()).hexdigest()
    cache = tmp_path / "cache"
    cfg = DataConfig(path=f"{base}/corpus.txt", sha256=good, cache_dir=str(cache))
    text, source = load_corpus(cfg)
    assert text == body and "cached at" in source
    assert corpus_cache_path(cfg).read_text(encoding="utf-8") == body
    # a wrong hash: refused, and nothing (not even a partial file) is left in the cache
    bad = DataConfig(path=f"{base}/corpus.txt", sha256="0" * 64, cache_dir=str(tmp_path / "cache2"))
    with pytest.raises(UsageError, match="sha256 .* expected 000000000000"):
        load_corpus(bad)
    assert not any((tmp_path / "cache2").iterdir())
    # the server is gone: the cached copy is used without a download
    stop()
    again, _ = load_corpus(cfg)
    assert again == body
    # a cached copy that no longer matches data.sha256 is refused with the fix
    corpus_cache_path(cfg).write_text("tampered", encoding="utf-8")
    with pytest.raises(UsageError, match="delete it to download again"):
        load_corpus(cfg)


def test_unreachable_url_falls_back_with_one_warning_or_fails_cleanly(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/x.txt"
    cfg = DataConfig(path=url, cache_dir=str(tmp_path / "cache"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text, source = load_corpus(cfg)
    assert source == "python-stdlib-fallback" and text == fallback_corpus() and len(text) > 1_000_000
    assert len(caught) == 1 and "cannot download" in str(caught[0].message)
    assert "\n" not in str(caught[0].message)
    with pytest.raises(UsageError, match="no cached copy exists"):
        load_corpus(DataConfig(path=url, cache_dir=str(tmp_path / "cache"), offline_fallback=False))


@pytest.mark.launch
def test_main_runs_offline_on_the_fallback_corpus(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/x.txt"
    r = python(["main.py", *TINY, f"data.path={url}", f"data.cache_dir={tmp_path / 'cache'}",
                "trainer.max_steps=2", "trainer.sample_tokens=0", f"trainer.run_dir={tmp_path / 'run'}"],
               timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    warning_lines = [l for l in r.stderr.splitlines() if l.startswith("warning:")]
    assert len(warning_lines) == 1 and "cannot download" in warning_lines[0], r.stderr
    assert "Traceback" not in r.stderr and "python-stdlib-fallback" in r.stdout
    assert (tmp_path / "run" / "model.pt").is_file()
