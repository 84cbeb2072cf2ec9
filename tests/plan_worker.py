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

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402

from costs.measure import SavedBytes  # noqa: E402
from harness import TINY  # noqa: E402


def run_case(overrides: list[str], run_dir: Path) -> dict:
    from launch.build import build_trainer

    from config import load_config
    from parallel.env import init_distributed

    cfg = load_config(None, TINY + [f"trainer.run_dir={run_dir}", "trainer.device=cpu"] + overrides)
    trainer = build_trainer(cfg, init_distributed(cfg), run_dir)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"))
    args = ap.parse_args()
    out = Path(args.out)
    for name, overrides in args.case:
        result = run_case(overrides.split(), out / f"run-{name}")
        if dist.get_rank() == 0:
            (out / f"{name}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
