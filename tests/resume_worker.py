"""Run under torchrun (2 processes) by tests/test_resume_rules.py.

One run folder, three launches' worth of training in one process group, with dropout on:
dp=2 (ddp) for 4 steps -> resumed as tp=2 for 3 steps -> resumed as tp=2 again for 2 steps.
After each resumed segment every rank gathers the tp peers' copies of each replicated parameter
(plain tensors and DTensors with only Replicate placements) and rank 0 writes the largest
difference per parameter to OUT/tp_replicas.json."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402
from launch.build import build_trainer  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402

from config import load_config  # noqa: E402
from harness import TINY  # noqa: E402
from parallel.env import init_distributed  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = Path(ap.parse_args().out)
    run_dir = out / "run"
    report = {}
    for name, overrides in PHASES:
        cfg = load_config(None, COMMON + [f"trainer.run_dir={run_dir}", *overrides])
        trainer = build_trainer(cfg, init_distributed(cfg), run_dir)
        meta = trainer.resume()
        assert (meta is not None) == (name != "dp2"), name
        trainer.train()
        if cfg.parallel.tp > 1:
            report[name] = replicated_diffs(trainer)
    if dist.get_rank() == 0:
        (out / "tp_replicas.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
