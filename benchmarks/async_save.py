"""How long the step loop is blocked by a snapshot save, synchronous vs in the background
(trainer.async_save), for a model whose save takes seconds: GPT-2 small's shape (12 x 768, the
char vocabulary: 85M parameters, ~1 GB of weights and AdamW state per snapshot), one process.

    python benchmarks/async_save.py              # 4 saves each way, the snapshots in a temp folder
    python benchmarks/async_save.py --dir /mnt/nfs/scratch

Each run saves after every step; the figures are metrics.jsonl's save_blocking_ms (the loop waited)
and save_total_ms (start to commit) of each save that was logged, and the run's wall time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)

from testing.local import CORPUS, python

MODEL = [f"data.path={CORPUS}", "model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=64",
         "trainer.batch_size=2", "trainer.save_every=1", "trainer.log_every=1", "trainer.eval_every=0",
         "trainer.sample_tokens=0", "trainer.keep_snapshots=2", "wandb.enabled=false"]


def measure(folder: Path, background: bool, saves: int) -> tuple[list[float], list[float], float]:
    run = folder / f"run_{'async' if background else 'sync'}"
    start = time.perf_counter()
    r = python(["main.py", *MODEL, f"trainer.max_steps={saves + 2}", f"trainer.async_save={str(background).lower()}",
                f"trainer.run_dir={run}"], timeout=1800)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [row for row in rows if "save_total_ms" in row]
    return [row["save_blocking_ms"] for row in timed], [row["save_total_ms"] for row in timed], wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the run folders go (default: a temp folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for background in (False, True):
            blocking, total, wall = measure(Path(d), background, args.saves)
            print(f"async_save={str(background).lower():5}: loop blocked {statistics.median(blocking):8.0f} ms per save "
                  f"(median of {len(blocking)}), save start to commit {statistics.median(total):8.0f} ms, "
                  f"run {wall:.0f} s")


if __name__ == "__main__":
    main()
