"""Run under torchrun by tests/test_initial_weights.py: every --case's layout is built as a launch
builds it (launch/build.py: the GPT on the meta device, split, sharded, this rank's share filled),
its whole initial parameters gathered on rank 0 (Strategy.full_model_state_dict), and compared bit
for bit with the one-process model of the same seed (model.GPT(cfg, seed)). Rank 0 writes, per case,
the names of the parameters that differ (or are missing) to OUT/initial.json."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from harness import run_worker
from model import GPT, GPTConfig
from testing.parity import build


def body(args) -> None:
    report = {}
    for name, overrides in args.case:
        trainer = build(overrides.split(), args.out / name)
        whole = trainer.strategy.full_model_state_dict()
        if dist.get_rank() == 0:
            one = GPT(GPTConfig(**trainer.model_config), seed=trainer.cfg.trainer.seed).state_dict()
            report[name] = sorted(k for k in one if k not in whole or not torch.equal(whole[k], one[k]))
            report[name] += sorted(k for k in whole if k not in one)
        dist.barrier()
    if dist.get_rank() == 0:
        (args.out / "initial.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    run_worker(body)
