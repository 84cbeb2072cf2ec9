"""Corpora that do not fit in memory: prepare.py's multi-process streaming
tokenizer and its folder format, nanoGPT's train.bin/val.bin, batches read through numpy.memmap
that equal the in-memory ones at every dp size, resident memory on a 1 GB token file, the corpus
identity a resume compares, and every damaged token corpus refused with one line, exit 2, the
run folder untouched."""
from __future__ import annotations

import json
import pickle
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import main as app
import prepare
from char_dataset import Batching, TokenDataset
from corpus.build import start_method
from corpus.token_files import GPT2_VOCAB, SIDECAR, TokenFiles, open_token_corpus, probe
from corpus.tokenizers import CharTokenizer, GPT2Tokenizer
from test_config import digests
from testing.local import TINY, python

EOT = 50256
# TINY on a token corpus: its data.truncate counts characters of a text, refused for tokens
ON_TOKENS = TINY + ["data.truncate=0", "data.tokenizer=gpt2"]


def all_ids(folder, split=None) -> np.ndarray:
    rec = json.loads((folder / SIDECAR).read_text())
    shards = rec["train"] + rec["val"] if split is None else rec[split]
    return np.concatenate([np.fromfile(folder / s["file"], dtype=rec["dtype"]) for s in shards])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus):
    """The Shakespeare text as a folder of two files (plus a hidden one prepare.py skips), prepared
    into small shards and chunks: gpt2 by 2 worker processes, char in this process."""
    root = tmp_path_factory.mktemp("tokens")
    text = corpus.read_text(encoding="utf-8")
    cut = text.index("\n", 600_000) + 1
    (root / "in" / "b").mkdir(parents=True)
    (root / "in" / "a.txt").write_text(text[:cut], encoding="utf-8")
    (root / "in" / "b" / "c.txt").write_text(text[cut:], encoding="utf-8")
    (root / "in" / ".hidden").write_text("not read", encoding="utf-8")
    for kind, workers in (("gpt2", "2"), ("char", "1")):
        assert prepare.main([str(root / "in"), "--tokenizer", kind, "--out", str(root / kind), "--workers", workers,
                             "--chunk-bytes", "100000", "--shard-tokens", "150000"]) == 0
    return root, text[:cut], text[cut:]


@pytest.mark.launch
def test_prepare_streams_the_tokenizers_ids_into_shards_with_a_line_break_val_split(prepared, tmp_path, capsys):
    root, a, c = prepared
    gpt2, char = GPT2Tokenizer(), CharTokenizer.from_corpus(a + c)
    # the ids of a whole-text encode (chunks cut where it changes nothing), <|endoftext|> after each file
    want = np.concatenate([gpt2.encode(a).numpy(), [EOT], gpt2.encode(c).numpy(), [EOT]])
    assert np.array_equal(all_ids(root / "gpt2"), want)
    assert np.array_equal(all_ids(root / "char"), char.encode(a + c).numpy())
    rec = json.loads((root / "char" / SIDECAR).read_text())
    assert rec["dtype"] == "uint8" and rec["tokenizer"] == char.to_dict() and rec["vocab_size"] == 65
    assert len(rec["train"]) == 7 and len(rec["val"]) == 1  # 150k-token shards
    # val: the text from a line break at the last 10% of the bytes on; contiguous, disjoint
    train = char.decode(all_ids(root / "char", "train").tolist())
    assert (a + c).startswith(train) and train.endswith("\n")
    assert abs(len(train.encode()) / len((a + c).encode()) - 0.9) < 0.001
    for kind in ("gpt2", "char"):
        assert prepare.main(["--verify", str(root / kind)]) == 0
    assert "ok: " in capsys.readouterr().out
    # --verify re-hashes whole shards: it finds a changed byte wherever it is
    shutil.copytree(root / "char", tmp_path / "changed")
    shard = tmp_path / "changed" / "train_000003.bin"
    data = bytearray(shard.read_bytes())
    data[123_456] = (data[123_456] + 1) % 65
    shard.write_bytes(bytes(data))
    assert prepare.main(["--verify", str(tmp_path / "changed")]) == 2
    assert "does not match its sha256" in capsys.readouterr().err


@pytest.mark.launch
def test_batches_from_shards_equal_the_in_memory_ones_at_every_dp_size(prepared):
    root, _, _ = prepared
    rec = json.loads((root / "gpt2" / SIDECAR).read_text())
    split = {s: TokenFiles([root / "gpt2" / x["file"] for x in rec[s]], [x["tokens"] for x in rec[s]], "uint16")
             for s in ("train", "val")}
    on_disk = TokenDataset(split["train"], split["val"], 16, seed=5)
    in_memory = TokenDataset(*(torch.from_numpy(all_ids(root / "gpt2", s).astype(np.int64)) for s in ("train", "val")),
                             16, seed=5)
    bounds = np.cumsum([x["tokens"] for x in rec["train"]])[:-1]
    crossing = 0
    epoch = on_disk.steps_per_epoch(64)
    for step in [*range(epoch), epoch + 7]:  # every window of an epoch: some cross a shard boundary
        starts = on_disk.train_starts(step, 64).numpy()
        crossing += int(((starts[:, None] < bounds) & (starts[:, None] + 17 > bounds)).sum())
        whole = in_memory.train_batch(step, Batching(64))
        for dp in (1, 2, 4) if step % 50 == 7 else (1,):
            shares = [on_disk.train_batch(step, Batching(64, r, dp)) for r in range(dp)]
            assert torch.equal(torch.cat([x for x, _ in shares]), whole[0])
            assert torch.equal(torch.cat([y for _, y in shares]), whole[1])
    assert crossing >= len(bounds), "a shard boundary no window crossed: the test proves less than it says"
    for (x, y), (x2, y2) in zip(on_disk.val_batches(3, Batching(8)), in_memory.val_batches(3, Batching(8))):
        assert torch.equal(x, x2) and torch.equal(y, y2)


class Unpickled:
    """Unpickling it creates the file `marker` (pickle calls Path.touch)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).touch, ())


@pytest.mark.launch
def test_a_1gb_token_file_trains_without_resident_memory_growing_with_it(tmp_path):
    """Two launches differ only in the size of train.bin (sparse: no disk or page cache filled): the
    1 GB one's peak resident memory may exceed the 100 KB one's by < 10% of the file. What does grow
    with the corpus is the epoch's window permutation, 4 bytes per window: 32 MB here at block 64."""
    peaks = {}
    for name, size in (("small", 100_000), ("big", 1 << 30)):
        folder = tmp_path / name
        folder.mkdir()
        with open(folder / "train.bin", "wb") as f:
            f.truncate(size)  # uint16 id 0 everywhere
        (np.arange(5000) % GPT2_VOCAB).astype(np.uint16).tofile(folder / "val.bin")
        # nanoGPT's meta.pkl is never unpickled: this one would leave a file behind if it were
        (folder / "meta.pkl").write_bytes(pickle.dumps(Unpickled(str(folder / "unpickled"))))
        r = python(["main.py", *ON_TOKENS, f"data.path={folder / 'train.bin'}", "trainer.max_steps=4",
                    "trainer.log_every=2", "trainer.eval_every=100", "model.block_size=64", "trainer.peak_flops=1e12",  # no peak measured: a fair baseline
                    "trainer.sample_tokens=0", f"trainer.run_dir={folder / 'run'}"], timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        peaks[name] = max(row["rss_peak_mb"] for row in rows if "rss_peak_mb" in row)
        (folder / "train.bin").unlink()
        assert not (folder / "unpickled").exists()
    print(f"peak RSS: {peaks['small']:.0f} MB on 100 KB, {peaks['big']:.0f} MB on 1 GB")
    assert peaks["big"] - peaks["small"] < 0.1 * 1024, peaks


# ----------------------------------------------------------------------------- bad token corpora


@pytest.fixture(scope="module")
def token_run(prepared, tmp_path_factory):
    """A run folder with a snapshot of 2 steps on the prepared gpt2 corpus."""
    root, _, _ = prepared
    run = tmp_path_factory.mktemp("token-run") / "run"
    assert app.main(ON_TOKENS + [f"data.path={root / 'gpt2'}", "trainer.max_steps=2", "trainer.save_every=2",
                                 "trainer.sample_tokens=0", f"trainer.run_dir={run}"]) == 0
    return run, digests(run)


def edit_sidecar(folder, **changes) -> None:
    rec = json.loads((folder / SIDECAR).read_text())
    rec.update(changes)
    (folder / SIDECAR).write_text(json.dumps(rec))


def chop(path, n_bytes: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - n_bytes)


def put_id(path, position: int, value: int) -> None:
    ids = np.fromfile(path, dtype=np.uint16)
    ids[position] = value
    ids.tofile(path)


def honest_sidecar_lying_about_max(folder, _) -> None:
    """A shard holding id 60000 whose hashes and probe are recomputed, with max_token left as it was:
    a sidecar consistent with its shards except for the largest id."""
    put_id(folder / "train_000001.bin", 77, 60_000)
    rec = json.loads((folder / SIDECAR).read_text())
    rec["train"][1]["probe_sha256"] = probe(folder / "train_000001.bin", "uint16")[0]
    (folder / SIDECAR).write_text(json.dumps(rec))


def nanogpt(folder, prepared_gpt2, val=True, train_id=None, odd=False) -> None:
    """nanoGPT's train.bin/val.bin in `folder`, from the ids of the prepared gpt2 corpus."""
    ids = all_ids(prepared_gpt2)
    folder.mkdir()
    if train_id is not None:
        ids[1234] = train_id
    ids[:300_000].tofile(folder / "train.bin")
    if val:
        ids[300_000:].tofile(folder / "val.bin")
    if odd:
        with open(folder / "train.bin", "ab") as f:
            f.write(b"\0")


def char_with_300_characters(folder, _) -> None:
    edit_sidecar(folder, tokenizer={"kind": "char", "chars": "".join(map(chr, range(0x100, 0x100 + 300)))},
                 vocab_size=300)


# name: (the prepared corpus `kind` copied (None: a new folder), what to do to the copy (given it and
#        the prepared gpt2 folder), the data.path under the copy, extra overrides, words of the error)
BAD_CORPORA = {
    "shard size not a whole number of ids": (
        "gpt2", lambda d, g: chop(d / "train_000000.bin", 1), "", [], "is truncated: 299999 bytes"),
    "shard shorter than the sidecar says": (
        "gpt2", lambda d, g: chop(d / "val_000000.bin", 2), "", [], "tokens but corpus.json says"),
    "sidecar counts not its shards'": (
        "gpt2", lambda d, g: edit_sidecar(d, train=[{**s, "tokens": s["tokens"] + 1} for s in
                                                 json.loads((d / SIDECAR).read_text())["train"]]),
        "", [], "tokens but corpus.json says 150001"),
    "shard content not the sidecar's": (
        "gpt2", lambda d, g: put_id(d / "train_000001.bin", 70_000, 11), "", [], "does not match corpus.json"),
    "uint16 cannot hold the sidecar's vocabulary": (
        "gpt2", lambda d, g: edit_sidecar(d, dtype="uint8"), "", [], "dtype uint8 holds ids below 256, fewer than"),
    "char uint8 with 300 characters": (
        "char", char_with_300_characters, "", ["data.tokenizer=char"], "dtype uint8 holds ids below 256"),
    "sidecar records an id >= vocab": (
        "gpt2", lambda d, g: edit_sidecar(d, max_token=GPT2_VOCAB), "", [], "records token id 50257"),
    "shard holds an id >= vocab the sidecar hides": (
        "gpt2", honest_sidecar_lying_about_max, "", [], "holds token id 60000"),
    "unfinished folder": (
        "gpt2", lambda d, g: (d / SIDECAR).unlink(), SIDECAR, [], "corpus.json does not exist"),
    "damaged sidecar": (
        "gpt2", lambda d, g: (d / SIDECAR).write_text("{"), "", [], "is damaged (not JSON)"),
    "another tokenizer": ("char", lambda d, g: None, "", [], "was prepared with --tokenizer char"),
    "a .bin id >= vocab": (None, lambda d, g: nanogpt(d, g, train_id=60_000), "train.bin", [],
                           "holds id 60000 at token 1234"),
    "a .bin of an odd size": (None, lambda d, g: nanogpt(d, g, odd=True), "train.bin", [], "is truncated: 600001 bytes"),
    "a .bin without val.bin": (None, lambda d, g: nanogpt(d, g, val=False), "train.bin", [], "no val file for"),
    "a .bin's named val file missing": (None, nanogpt, "train.bin", ["data.val_path={copy}/v.bin"], "fix data.val_path"),
    # the run's corpus identity is the sidecar's sha256: another one is another corpus (no re-hash)
    "another corpus to resume on": (
        "gpt2", lambda d, g: edit_sidecar(d, sha256="0" * 64), "", [], "corpus sha256="),
}


@pytest.mark.launch
@pytest.mark.parametrize("case", list(BAD_CORPORA))
def test_bad_token_corpus_is_one_line_exit_2_and_leaves_the_run_alone(case, prepared, token_run, tmp_path, capsys):
    root, _, _ = prepared
    run, before = token_run
    kind, damage, under, extra, words = BAD_CORPORA[case]
    copy = tmp_path / "corpus"
    if kind is not None:
        shutil.copytree(root / kind, copy)
    damage(copy, root / "gpt2")
    capsys.readouterr()
    rc = app.main(ON_TOKENS + [f"data.path={copy / under}", "trainer.max_steps=1", "trainer.sample_tokens=0",
                               f"trainer.run_dir={run}"] + [e.format(copy=copy) for e in extra])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"{case}: exit {rc}, stderr {err!r}"
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], f"{case}: {err!r}"
    assert digests(run) == before


@pytest.mark.launch
def test_the_same_corpus_elsewhere_resumes_and_python_main_py_says_one_line(prepared, token_run, tmp_path, capsys):
    root, _, _ = prepared
    run, before = token_run
    shutil.copytree(root / "gpt2", tmp_path / "moved")
    args = [*ON_TOKENS, "trainer.max_steps=2", f"trainer.run_dir={run}", f"data.path={tmp_path / 'moved'}"]
    capsys.readouterr()
    assert app.main(args) == 0 and "nothing left to train" in capsys.readouterr().out  # accepted as the same
    chop(tmp_path / "moved" / "train_000002.bin", 3)
    r = python(["main.py", *args], timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr and digests(run) == before


@pytest.mark.launch
def test_a_char_run_refuses_a_corpus_of_another_vocabulary(prepared, tmp_path, capsys):
    """The ids of a char corpus mean the characters of its own vocabulary: a run folder that learned
    another mapping (its tokenizer.json) is refused, even where every shard is intact."""
    root, _, _ = prepared
    run = tmp_path / "run"
    char = [*ON_TOKENS, "data.tokenizer=char", "trainer.max_steps=2", "trainer.sample_tokens=0", f"trainer.run_dir={run}"]
    assert app.main(char + [f"data.path={root / 'char'}", "trainer.save_every=2"]) == 0
    before = digests(run)
    shutil.copytree(root / "char", tmp_path / "swapped")
    chars = json.loads((root / "char" / SIDECAR).read_text())["tokenizer"]["chars"]
    edit_sidecar(tmp_path / "swapped", tokenizer={"kind": "char", "chars": chars[1] + chars[0] + chars[2:]})
    capsys.readouterr()
    assert app.main(char + [f"data.path={tmp_path / 'swapped'}", "trainer.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was prepared with another character vocabulary" in err, err
    assert digests(run) == before


@pytest.mark.launch
def test_open_reads_only_what_the_sidecar_names(prepared):
    """The corpus opens from its folder or its corpus.json, and its identity is the recorded hash."""
    root, _, _ = prepared
    a = open_token_corpus(str(root / "gpt2"), "gpt2")
    b = open_token_corpus(str(root / "gpt2" / SIDECAR), "gpt2")
    assert a.digest == b.digest == json.loads((root / "gpt2" / SIDECAR).read_text())["sha256"]
    assert a.train.numel() + a.val.numel() == all_ids(root / "gpt2").size


# ----------------------------------------------------------------------------- prepare.py bad input


@pytest.mark.launch
def test_prepare_bad_input_is_one_line_exit_2_and_leaves_no_shards(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "good.txt").write_text("First Citizen:\nSpeak.\n" * 5000, encoding="utf-8")
    (tmp_path / "in" / "latin1.txt").write_bytes("Roméo et Juliette\n".encode("latin-1") * 10)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        ([str(tmp_path / "in"), "--tokenizer", "char", "--out", str(tmp_path / "o1"), "--workers", "2"],
         "latin1.txt is not UTF-8 text (byte 3)"),
        ([str(tmp_path / "in"), "--tokenizer", "gpt2", "--out", str(tmp_path / "full")], "is not an empty folder"),
        ([str(tmp_path / "nope.txt"), "--tokenizer", "gpt2", "--out", str(tmp_path / "o2")], "does not exist"),
        ([str(tmp_path / "in"), "--tokenizer", "gpt2", "--out", str(tmp_path / "o3"), "--val-fraction", "1"],
         "--val-fraction must be between 0 and 1"),
        ([str(tmp_path / "in"), "--tokenizer", "bpe", "--out", str(tmp_path / "o4")], "invalid choice: 'bpe'"),
    ]
    for argv, words in cases:
        capsys.readouterr()
        assert prepare.main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # tqdm's bar aside
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err
    assert list((tmp_path / "o1").iterdir()) == []  # the failed run's shards are gone
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["x"]


def test_the_pool_forks_only_a_process_without_other_threads():
    """A fork while another thread holds a lock hangs the child: with a thread running, spawn."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert start_method() == "spawn"
    finally:
        stop.set()
        other.join()


def test_a_token_corpus_lends_its_tokenizer_when_data_tokenizer_is_not_set(corpus, tmp_path, capsys):
    """prepare.py's corpus.json names the tokenizer and a nanoGPT .bin holds GPT-2 ids: without
    data.tokenizer the run takes the corpus's (as model.init_from lends its shape); set, it is the
    user's, and a mismatch is still refused."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(corpus.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    assert prepare.main([str(tmp_path / "in"), "--tokenizer", "gpt2", "--out", str(tmp_path / "ts_gpt2"),
                         "--workers", "1"]) == 0
    for name in ("train.bin", "val.bin"):
        np.random.default_rng(0).integers(0, GPT2_VOCAB, 20_000).astype(np.uint16).tofile(tmp_path / name)
    unset = [o for o in TINY if not o.startswith("data.")] + ["trainer.max_steps=1", "trainer.sample_tokens=0"]
    for path, run in ((tmp_path / "ts_gpt2", "folder"), (tmp_path / "train.bin", "bin")):
        capsys.readouterr()
        assert app.main(unset + [f"data.path={path}", f"trainer.run_dir={tmp_path / run}"]) == 0, capsys.readouterr().err
        assert "tokenizer: gpt2" in (tmp_path / run / "config.yaml").read_text(), run
        assert "vocab 50257 (gpt2)" in capsys.readouterr().out
    assert app.main(unset + [f"data.path={tmp_path / 'ts_gpt2'}", "data.tokenizer=char",
                             f"trainer.run_dir={tmp_path / 'set'}"]) == 2
    assert "was prepared with --tokenizer gpt2 but data.tokenizer=char" in capsys.readouterr().err
