"""Elastic membership, measured: a job on two nodes loses one and goes on alone.

Two torchrun agents on this machine act as two nodes (testing/multinode.py; `--nnodes=1:2`,
c10d rendezvous, one process per node, fsdp). Once training reached step --lose-at, node B is
SIGKILLed whole (agent and worker: the node is gone). Node A's worker fails on the broken
connection, A's agent re-forms the group without B (world size 1), and the worker resumes from
the newest snapshot (the steps after it are recomputed) with the same global batch and data order. The script
also runs the same job uninterrupted on two nodes and in one process, and writes:

- a PNG (matplotlib): the train loss of every step of the uninterrupted two-node run and of the
  node-lost run, and their per-step difference;
- the figures: where the node was lost, where the survivor resumed, how long the re-forming took,
  and the largest loss difference after the resume step against both references.

    python benchmarks/elastic_membership.py                             # 400 steps, node lost at step 175
    python benchmarks/elastic_membership.py --steps 1000 --lose-at 420 --out /tmp/elastic.png
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from _repo import REPO
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from testing.local import TINY, python
from testing.multinode import snapshot_steps, two_nodes, wait_all, wait_for


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lose-at", type=int, default=175, help="lose node B once training reached this step")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "elastic_membership.png")
    args = ap.parse_args()
    cfg = TINY + ["trainer.sample_tokens=0", "parallel.strategy=fsdp", "model.n_embd=64",
                  f"trainer.max_steps={args.steps}", f"trainer.save_every={args.save_every}",
                  "trainer.log_every=1", f"trainer.eval_every={args.steps}"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        one, two, lost = tmp / "one", tmp / "two", tmp / "lost"
        (tmp / "logs-two").mkdir()
        (tmp / "logs-lost").mkdir()
        t0 = time.perf_counter()
        r = python(["main.py", *cfg, "parallel.strategy=none", f"trainer.run_dir={one}"], timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        wall_one = time.perf_counter() - t0

        t0 = time.perf_counter()
        with two_nodes(tmp / "logs-two", cfg + [f"trainer.run_dir={two}"]) as nodes:
            assert wait_all(nodes, timeout=600) == [0, 0], nodes[0].output()[-3000:]
        wall_two = time.perf_counter() - t0

        t0 = time.perf_counter()
        with two_nodes(tmp / "logs-lost", cfg + [f"trainer.run_dir={lost}"], nnodes="1:2", max_restarts=3) as (a, b):
            def reached() -> int:  # the last step rank 0 (on A or B) logged
                return max(map(int, re.findall(r"^step (\d+)/", a.output() + b.output(), re.M)), default=0)
            wait_for(lambda: "layout: world 2 " in a.output() + b.output() and reached() >= args.lose_at,
                     (a, b), f"step {args.lose_at} on two nodes", timeout=600)
            b.kill()
            t_kill = time.perf_counter()
            lost_at, lost_after = reached(), max(snapshot_steps(lost))
            t_reformed = None
            while a.proc.poll() is None:
                if t_reformed is None and "layout: world 1 " in a.output():
                    t_reformed = time.perf_counter()
                time.sleep(0.05)
            assert a.proc.returncode == 0, a.output()[-3000:]
            out = a.output()
        wall_lost = time.perf_counter() - t0
        resumed = re.findall(r"^layout: world (\d+) .*$\n.*\n^run: .*resumed from \S+step_(\d+) at step", out, re.M)
        assert resumed and resumed[-1][0] == "1", out[-3000:]
        start = int(resumed[-1][1])

        ref1, ref2, got = losses(one), losses(two), losses(lost)
        assert sorted(got) == sorted(ref2) == sorted(ref1) == list(range(1, args.steps + 1))
        after = [s for s in got if s > start]
        rel2 = {s: abs(got[s] - ref2[s]) / ref2[s] for s in got}
        worst2 = max(rel2[s] for s in after)
        worst1 = max(abs(got[s] - ref1[s]) / ref1[s] for s in after)
        worst_two_vs_one = max(abs(ref2[s] - ref1[s]) / ref1[s] for s in got)

    steps = sorted(got)
    fig = Figure(figsize=(10, 6.4), dpi=100)
    FigureCanvasAgg(fig)
    ax, dx = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(steps, [ref2[s] for s in steps], color="tab:blue", lw=2.5, label="uninterrupted, 2 nodes")
    ax.plot(steps, [got[s] for s in steps], color="tab:orange", lw=1, label="node B lost: 2 nodes, then node A alone")
    ax.axvline(start, color="gray", ls="--", lw=1)
    ax.text(start, max(got.values()), f"  node B killed at step {lost_at};\n  node A resumed alone (world 1)\n"
            f"  from the snapshot of step {start}", va="top", fontsize=9)
    ax.set_ylabel("train loss")
    ax.set_title("elastic membership: fsdp on 2 nodes (--nnodes=1:2), one node lost")
    ax.legend(loc="lower left")
    dx.plot(steps, [rel2[s] for s in steps], color="tab:orange", lw=1)
    dx.axvline(start, color="gray", ls="--", lw=1)
    dx.set_yscale("symlog", linthresh=1e-8)
    dx.set_ylim(0, 1e-4)
    dx.set_ylabel("|lost - uninterrupted| / loss")
    dx.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(args.out)

    print(f"steps {args.steps}, snapshots every {args.save_every}, global batch 8 x 16 tokens, fsdp")
    print(f"one process: {wall_one:.1f} s wall; uninterrupted 2 nodes: {wall_two:.1f} s; node lost: {wall_lost:.1f} s")
    print(f"node B killed at step {lost_at} (newest snapshot: step {lost_after})")
    print(f"node A re-formed alone and printed its resumed start-up {t_reformed - t_kill:.1f} s after the kill, "
          f"resuming from step {start} at world size 1 ({lost_at - start} steps recomputed)")
    print(f"loss after step {start}, largest relative difference: {worst2:.2e} vs uninterrupted 2 nodes, "
          f"{worst1:.2e} vs one process (2 nodes vs one process over all steps: {worst_two_vs_one:.2e})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
