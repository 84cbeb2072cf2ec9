"""The dry run (main.py --dry-run) over the layouts of a large job: GPT-2 XL and a 20B-parameter
shape at 512 and 1,024 ranks, for fsdp x tp x pp, HSDP, ZeRO stages 1-3, ddp x pp and every
pipeline schedule. Each case is its own `python main.py --dry-run` (one process, torch's fake
process group); the table says its exit code (0 agrees with the planner, 1 a disagreement, 2 a
layout the launch refuses), the simulated ranks, the seconds and the first line that matters.

    python benchmarks/dry_run_matrix.py --out docs/dry-run-matrix.md
    python benchmarks/dry_run_matrix.py --only "20b fsdp" --worlds 1024
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from _repo import REPO

XL = ["model.size=gpt2-xl", "model.block_size=1024"]  # 48 x 1600, 25 heads, 1.56B parameters
# 20.3B parameters: 44 x 6144, 64 heads (GPT-NeoX-20B's shape), sequence 2048; 44 blocks split
# unevenly over 8 stages, so stages of 5 and 6 blocks are both simulated
B20 = ["model.n_layer=44", "model.n_embd=6144", "model.n_head=64", "model.block_size=2048"]
SPLIT8 = "parallel.pp_split=5,6,5,6,5,6,5,6"
COMMON = ["trainer.device=cpu", "data.tokenizer=gpt2"]


def cases(world: int) -> dict[str, list[str]]:
    """name -> overrides; batch = world sequences (one per data-parallel rank and micro-batch)."""
    batch = f"trainer.batch_size={world}"
    pp4 = ["parallel.pp=4", "parallel.microbatches=8", f"trainer.batch_size={2 * world}"]  # 8 sequences per dp rank
    schedules = {
        "gpipe": ["parallel.pp_schedule=gpipe"],
        "1f1b": ["parallel.pp_schedule=1f1b"],
        "interleaved v2": ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"],
        "zero-bubble": ["parallel.pp_schedule=zero_bubble"],
        "zero-bubble V": ["parallel.pp_schedule=zero_bubble", "parallel.pp_stages_per_rank=2"],
    }
    out = {
        "xl fsdp x tp8 x pp8 (25 heads: refused)": XL + [batch, "parallel.strategy=fsdp", "parallel.tp=8",
                                                       "parallel.pp=8"],
        "xl fsdp x pp8": XL + [batch, "parallel.strategy=fsdp", "parallel.pp=8"],
        "xl hsdp 8 replicas": XL + [batch, "parallel.strategy=fsdp", "parallel.dp_replicate=8"],
        "xl ddp x pp8": XL + [batch, "parallel.strategy=ddp", "parallel.pp=8"],
        "20b fsdp x tp8 x pp8": B20 + [batch, "parallel.strategy=fsdp", "parallel.tp=8", "parallel.pp=8", SPLIT8],
        "20b hsdp 8 replicas x tp8": B20 + [batch, "parallel.strategy=fsdp", "parallel.tp=8",
                                            "parallel.dp_replicate=8"],
        "20b ddp x tp8 x pp8": B20 + [batch, "parallel.strategy=ddp", "parallel.tp=8", "parallel.pp=8", SPLIT8],
    }
    # zero-bubble schedules refuse data parallelism: at this scale only tp x pp = world runs them,
    # e.g. a 128-block model (GPT-2 XL's width, 32 heads) on tp 8 x pp 64 (512 ranks) or pp 128
    deep = ["model.n_layer=128", "model.n_embd=1600", "model.n_head=32", "model.block_size=1024",
            "parallel.strategy=none", "parallel.tp=8", f"parallel.pp={world // 8}", "parallel.pp_schedule=zero_bubble",
            f"trainer.batch_size={world // 8}"]
    out["deep tp8 x pp zero-bubble"] = deep
    if world // 8 * 2 <= 128:
        out["deep tp8 x pp zero-bubble V"] = deep + ["parallel.pp_stages_per_rank=2"]
    for stage in (1, 2, 3):
        out[f"xl zero-{stage}"] = XL + [batch, "parallel.strategy=zero", f"parallel.zero_stage={stage}"]
        out[f"20b zero-{stage} x tp8"] = B20 + [batch, "parallel.strategy=zero", f"parallel.zero_stage={stage}",
                                                "parallel.tp=8"]  # zero-1/2 refuse tp: answered exit 2
        if stage < 3:
            out[f"20b zero-{stage}"] = B20 + [batch, "parallel.strategy=zero", f"parallel.zero_stage={stage}"]
    for name, sched in schedules.items():
        v2 = "parallel.pp_stages_per_rank=2" in sched
        out[f"xl fsdp x pp4 {name}"] = XL + ["parallel.strategy=fsdp", *pp4, *sched]
        out[f"20b fsdp x tp8 x pp4 {name}"] = B20 + ["parallel.strategy=fsdp", "parallel.tp=8", *pp4, *sched,
                                                     *([SPLIT8] if v2 else [])]
    return out


def run_case(world: int, overrides: list[str], timeout_s: int) -> tuple[int, float, str, str]:
    """(exit code, seconds, the summary line, the first disagreement or error line)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(REPO / "main.py"), "--dry-run", "--world-size", str(world), *COMMON, *overrides]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, time.perf_counter() - t0, "", f"timed out after {timeout_s} s"
    seconds = time.perf_counter() - t0
    lines = r.stdout.splitlines()
    head = next((x for x in lines if x.startswith("dry run:")), "")
    first = next((x.strip() for x in lines if x.startswith("disagreement")), "")
    if r.returncode and not first:
        first = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    return r.returncode, seconds, head, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="512,1024", help="comma-separated world sizes (default 512,1024)")
    ap.add_argument("--only", default="", help="run the cases whose name contains this text")
    ap.add_argument("--out", default="", help="also write the table as markdown to this file")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per case (default 1200)")
    args = ap.parse_args()
    rows = ["| world | layout | exit | simulated ranks | seconds | result |", "|---|---|---|---|---|---|"]
    for world in [int(w) for w in args.worlds.split(",")]:
        for name, overrides in cases(world).items():
            if args.only not in name:
                continue
            code, seconds, head, first = run_case(world, overrides, args.timeout)
            sims = re.search(r"\| (\d+) simulated ranks", head)
            result = {0: "every figure agrees within 1%", 2: f"refused: {first}"}.get(code, first)
            row = f"| {world} | {name} | {code} | {sims.group(1) if sims else '-'} | {seconds:.0f} | {result} |"
            print(row, flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
