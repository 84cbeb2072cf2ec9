"""Run under torchrun by tests/test_planner.py: what the planner predicts, measured on real ranks.

`--case NAME "OVERRIDES"` (repeatable, all in ONE launch): build TINY + overrides with main's
build_trainer, train two steps, and record on every rank
- the resident bytes of parameters, gradients and optimizer state after the second backward
  (Strategy.resident_bytes: read from the strategy's own local tensors), and
- the bytes saved for backward by the second step's forward/backward, counted as unique storages
  (saved_tensors_hooks; parameters excluded, a DTensor by its local shard) and divided by the
  forward/backwards of that step: the bytes one micro-batch saves on this rank (measure.SavedBytes).
Rank 0 writes OUT/NAME.json with every rank's figures, pipeline rank and micro-batch count.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from harness import run_worker
from testing.parity import build
from tools.measure import SavedBytes


def run_case(overrides: list[str], run_dir: Path) -> dict:
    trainer = build(["trainer.device=cpu", *overrides], run_dir)
    s = trainer.strategy
    trainer.forward_backward()  # step 1 (a pipeline also infers its shapes here)
    trainer.optimizer_step()
    saved = SavedBytes()
    with saved.hooks():
        trainer.forward_backward()
    memory = s.resident_bytes(trainer.optimizer)
    trainer.optimizer_step()
    forwards = s.layout.microbatches  # pipeline micro-batches or accumulation steps
    mine = {**memory, "activations_per_microbatch": saved.nbytes // forwards, "forwards": forwards,
            "pp_rank": s.coordinate.pp}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def body(args) -> None:
    for name, overrides in args.case:
        result = run_case(overrides.split(), args.out / f"run-{name}")
        if dist.get_rank() == 0:
            (args.out / f"{name}.json").write_text(json.dumps(result))
        dist.barrier()


if __name__ == "__main__":
    run_worker(body)
