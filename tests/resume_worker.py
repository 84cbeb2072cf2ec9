"""Run under torchrun (2 processes) by tests/test_resume_rules.py.

One run folder, three launches' worth of training in one process group, with dropout on:
dp=2 (ddp) for 4 steps -> resumed as tp=2 for 3 steps -> resumed as tp=2 again for 2 steps.
After each resumed segment every rank gathers the tp peers' copies of each replicated parameter
(plain tensors and DTensors with only Replicate placements) and rank 0 writes the largest
difference per parameter to OUT/tp_replicas.json."""
from __future__ import annotations

import json

import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from harness import run_worker
from testing.local import TINY
from testing.parity import build

COMMON = TINY + ["model.dropout=0.1", "optimizer.lr_decay_steps=20", "trainer.sample_tokens=0",
          "trainer.eval_every=1000", "trainer.eval_batches=1"]
PHASES = [("dp2", ["parallel.strategy=ddp", "trainer.max_steps=4"]),
          ("dp2_to_tp2", ["parallel.tp=2", "trainer.max_steps=7"]),
          ("tp2_to_tp2", ["parallel.tp=2", "trainer.max_steps=9"])]


def replicated_diffs(trainer) -> dict[str, float]:
    """Max |difference| over the tp peers of every replicated parameter, by name."""
    mine = {}
    for part in trainer.strategy.unwrapped():
        for name, p in part.named_parameters():
            if isinstance(p, DTensor):
                if not all(isinstance(pl, Replicate) for pl in p.placements):
                    continue
                p = p.to_local()
            mine[name] = p.detach().cpu().clone()
    group = trainer.strategy.mesh["tp"].get_group()
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {k: max((other[k] - v).abs().max().item() for other in everyone[1:])
            for k, v in everyone[0].items()}


def body(args) -> None:
    run_dir = args.out / "run"
    report = {}
    for name, overrides in PHASES:
        trainer = build(overrides, run_dir, base=COMMON)
        meta = trainer.resume()
        assert (meta is not None) == (name != "dp2"), name
        trainer.train()
        if trainer.cfg.parallel.tp > 1:
            report[name] = replicated_diffs(trainer)
    if dist.get_rank() == 0:
        (args.out / "tp_replicas.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    run_worker(body)
