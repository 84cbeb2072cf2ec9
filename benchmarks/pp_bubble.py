"""Measured pipeline bubble per schedule vs theory, for the layout table of docs/layouts.md.

For each schedule and micro-batch count m, trains a few steps of a small GPT split over p pipeline
ranks (torchrun, gloo, CPU) and measures on every rank:
    busy  = time inside the stage's compute (forward_one_chunk, backward_one_chunk,
            backward_weight_one_chunk, and the loss on the last stage)
    step  = wall time of the schedule's step() (the slowest rank's; all ranks start together
            after a barrier)
    bubble = 1 - busy / step   (idle time, p2p waits included), averaged over ranks and steps.
Theory for p ranks, m micro-batches, v stages per rank (equal stage times, free communication):
    gpipe, 1f1b       (p-1) / (m + p-1)
    interleaved_1f1b  (p-1) / (v*m + p-1)
    zero_bubble       ~0 when forward, input-backward and weight-backward take equal time
The micro-batch size is fixed (--micro sequences), so m changes the batch, not the work per
micro-batch. On a 2-core machine keep p = 2 (one core per rank); more ranks than cores measure
CPU contention, not the schedule.

    python benchmarks/pp_bubble.py                       # p=2, m in 2 4 8, every schedule
    python benchmarks/pp_bubble.py --microbatches 4 16 --steps 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)

from testing.local import CORPUS, torchrun
from tools.measure import StageClock, add_timer

# (label, overrides): stages per rank v is read back from the config
SCHEDULES = [
    ("gpipe", ["parallel.pp_schedule=gpipe"]),
    ("1f1b", ["parallel.pp_schedule=1f1b"]),
    ("interleaved_1f1b (v=2)", ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"]),
    ("zero_bubble (ZB1P, v=1)", ["parallel.pp_schedule=zero_bubble"]),
    ("zero_bubble (ZB-V, v=2)", ["parallel.pp_schedule=zero_bubble", "parallel.pp_stages_per_rank=2"]),
]
MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.block_size=64",
         "model.dropout=0.0", "data.truncate=300000", "trainer.eval_batches=1", "wandb.enabled=false",
         "trainer.sample_tokens=0", "trainer.save_every=0", "trainer.resume=never"]


def theory(schedule: str, p: int, m: int, v: int) -> float | None:
    if schedule.startswith("zero_bubble"):
        return None
    return (p - 1) / (v * m + p - 1)


def measure(overrides: list[str], steps: int, warmup: int, run_dir: Path) -> dict:
    """Collective: (mean bubble over ranks and timed steps, median step ms) for one layout."""
    import torch
    import torch.distributed as dist

    from checks import load_config
    from launch.build import build_trainer
    from parallel.env import init_distributed

    cfg = load_config(None, overrides + [f"trainer.run_dir={run_dir}"])
    env = init_distributed(cfg)
    trainer = build_trainer(cfg, env, run_dir)
    pipe = trainer.strategy.runner  # parallel.pp.Pipeline
    busy, step_time = StageClock(pipe).busy, [0.0]
    add_timer(pipe.schedule, "step", step_time)
    bubbles, steps_ms = [], []
    for step in range(warmup + steps):
        busy[0] = step_time[0] = 0.0
        dist.barrier()
        trainer.train_step()
        times = torch.tensor([busy[0], step_time[0]])
        gathered = [torch.zeros(2) for _ in range(env.world_size)]
        dist.all_gather(gathered, times)
        if step >= warmup:
            slowest = max(float(t[1]) for t in gathered)
            bubbles.append(statistics.mean(1 - float(t[0]) / slowest for t in gathered))
            steps_ms.append(1000 * slowest)
    return {"bubble": statistics.mean(bubbles), "bubble_min": min(bubbles), "bubble_max": max(bubbles),
            "step_ms": statistics.median(steps_ms)}


def worker(args) -> None:
    import torch.distributed as dist

    results = []
    for label, sched in SCHEDULES:
        for m in args.microbatches:
            v = 2 if "parallel.pp_stages_per_rank=2" in sched else 1
            overrides = MODEL + sched + [
                f"data.path={CORPUS}", f"parallel.pp={args.pp}", f"parallel.microbatches={m}",
                f"trainer.batch_size={m * args.micro}", "trainer.micro_batch_size=0",
                "parallel.strategy=none"]
            with tempfile.TemporaryDirectory() as tmp:
                r = measure(overrides, args.steps, args.warmup, Path(tmp))
            r.update(schedule=label, p=args.pp, v=v, m=m, theory=theory(label, args.pp, m, v))
            results.append(r)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def table(results: list[dict]) -> str:
    rows = ["| schedule | p | v | m | measured bubble (min-max) | theory | step ms |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        th = f"{r['theory']:.2f}" if r["theory"] is not None else "~0 if t_F = t_B = t_W"
        rows.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {r['bubble']:.2f} "
                    f"({r['bubble_min']:.2f}-{r['bubble_max']:.2f}) | {th} | {r['step_ms']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (= processes)")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8], help="micro-batch counts m to measure")
    ap.add_argument("--micro", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bubble.json"
        cmd = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--pp", str(args.pp),
               "--micro", str(args.micro), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--microbatches", *map(str, args.microbatches)]
        r = torchrun(args.pp, cmd, timeout=300)  # holds the machine-wide multi-process lock
        if r.returncode != 0:
            sys.exit(f"benchmark failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        results = json.loads(out.read_text())
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
