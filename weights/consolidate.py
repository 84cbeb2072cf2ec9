"""One snapshot, any layout, reassembled into plain single-process tensors in one process.

A snapshot written by any strategy (ddp, zero, fsdp, tp, pp, meshes) stores parameters under
their plain names, sharded by DCP. Here one process, with no process group, takes the model's
names and shapes from the snapshot's recorded shape (on the meta device: no bytes) and lets DCP
reassemble each tensor from its shards when it is asked for, through the restricted reader
(nothing in the snapshot is unpickled): one whole tensor at a time, never the whole model.
export.py writes the result as model.pt (or a Hugging Face folder); sample.py --snapshot samples
from it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from config import UsageError
from snapshots.format import (
    SnapshotMeta,
    UnsafeSnapshot,
    list_snapshots,
    other_format_refusal,
    step_dir_name,
    validate_snapshot,
)
from snapshots.store import load_tensors
from weights.model_file import LazyTensors, ModelFile, model_layout


def consolidate(run_dir: Path, step: int | None) -> ModelFile:
    """The model.pt contents from the snapshot at `step` (None: the newest valid one)."""
    found = list_snapshots(run_dir / "snapshots")
    snaps = found if step is None else [p for p in found if p.name == step_dir_name(step)]
    if not snaps:
        if not found:
            raise UsageError(f"no snapshot {'at all' if step is None else f'at step {step}'} in "
                             f"{run_dir / 'snapshots'}: there are none; check --run-dir (snapshots "
                             f"are written every trainer.save_every steps and at the end)")
        steps = ", ".join(str(int(p.name[len("step_"):])) for p in reversed(found))
        raise UsageError(f"no snapshot at step {step} in {run_dir / 'snapshots'}; it has steps "
                         f"{steps}: pick one with --step (or leave --step out for the newest)")
    for path in snaps:
        record, why = validate_snapshot(path)
        if record is None:
            if step is not None:
                raise UsageError(other_format_refusal(path)
                                 or f"snapshot {path} is damaged ({why}); pick another --step")
            print(f"warning: skipping snapshot {path}: {why}", file=sys.stderr)
            continue
        meta = SnapshotMeta.from_record(record)
        layout = model_layout(meta.model_config)
        shapes = {k: tuple(v.shape) for k, v in layout.items()}
        return ModelFile.from_snapshot(meta, LazyTensors(shapes, lambda name, p=path: _read(p, name, layout[name])))
    raise UsageError(f"no valid snapshot in {run_dir / 'snapshots'}; every one is damaged")


def _read(path: Path, name: str, like: torch.Tensor) -> torch.Tensor:
    """One parameter of the snapshot at `path`, whole (DCP reads only its shards)."""
    state = {"model": {name: torch.empty(like.shape, dtype=like.dtype)}}
    try:  # tensors only, through the restricted reader: nothing in the snapshot is unpickled
        load_tensors(path, state)
    except UnsafeSnapshot as e:  # changed since validate_snapshot read it
        raise UsageError(f"snapshot {path} is unsafe to load ({e}); pick another --step") from None
    return state["model"][name]
