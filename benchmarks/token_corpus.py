"""What a token corpus costs a launch, measured: a 1 GB nanoGPT train.bin of random GPT-2 ids
(written into a temporary folder and deleted after), and prepare.py's throughput on a text.

Printed, for the 1 GB file (second read: the page cache holds it, as on any launch after the first):
- the chunked max over the whole file, which every launch on a .bin runs (token_files.max_token);
- its sha256, what a launch would pay to re-hash it (and does not: token_files' docstring);
- the probe a launch reads of each prepared shard (token_files.probe);
- the epoch's window permutation at block 1024 (the first batch of an epoch) and one batch's
  gather through numpy.memmap (median of 50), batch 16;
and prepare.py's tokens/s on TEXT (default the Tiny Shakespeare the tests use) with 1 and 2 workers.

    python benchmarks/token_corpus.py [--text FILE] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _repo import REPO

import prepare
from char_dataset import Batching, TokenDataset
from corpus.token_files import max_token, open_token_corpus, probe
from storage.files import sha256_file


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=str(REPO.parent / "shared" / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the 1 GB file is written")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        train, val = Path(tmp) / "train.bin", Path(tmp) / "val.bin"
        rng = np.random.default_rng(0)
        with open(train, "wb") as f:
            for _ in range(8):  # 8 x 64 Mi ids = 1 GiB
                rng.integers(0, 50257, 64 << 20, dtype=np.uint16).tofile(f)
        rng.integers(0, 50257, 1 << 20, dtype=np.uint16).tofile(val)
        gb = train.stat().st_size / 2**30
        max_token(train, "uint16")  # warm the page cache
        _, t_max = timed(max_token, train, "uint16")
        _, t_sha = timed(sha256_file, train)
        _, t_probe = timed(probe, train, "uint16")
        corpus, t_open = timed(open_token_corpus, str(train), "gpt2")
        data = TokenDataset(corpus.train, corpus.val, 1024, seed=1, digest=corpus.digest)
        _, t_perm = timed(data.train_batch, 0, Batching(16))
        gathers = [timed(data.train_batch, s, Batching(16))[1] for s in range(1, 51)]
        print(f"{gb:.2f} GiB uint16 .bin: chunked max {t_max:.2f} s | sha256 {t_sha:.2f} s | probe "
              f"{t_probe * 1e3:.1f} ms | open (max of train.bin and val.bin, probes) {t_open:.2f} s")
        print(f"block 1024: epoch permutation of {data.n_windows:,} windows {t_perm:.2f} s | a batch of 16 "
              f"windows through memmap {statistics.median(gathers) * 1e3:.2f} ms (median of 50)")
        for workers in (1, 2):
            out = Path(tmp) / f"prep{workers}"
            t = time.perf_counter()
            assert prepare.main([args.text, "--tokenizer", "gpt2", "--out", str(out), "--workers", str(workers)]) == 0
            dt = time.perf_counter() - t
            n = sum(p.stat().st_size for p in out.glob("*.bin")) // 2
            print(f"prepare.py --tokenizer gpt2 --workers {workers}: {n:,} tokens in {dt:.1f} s "
                  f"({n / dt:,.0f} tokens/s, process start-up included)")


if __name__ == "__main__":
    main()
