"""Consolidate a snapshot into a plain model.pt: `python export.py --run-dir runs/<name> [--step N]`.

The newest snapshot goes to `<run-dir>/model.pt`; `--step N` (or a model.pt that holds a later
step than the snapshot) writes `<run-dir>/model_step_<N>.pt` instead, so an older export never
replaces the run's final model. `sample.py --model FILE` and `model.init_from=FILE` read either.

`--format hf --out DIR` writes a Hugging Face GPT-2 folder instead (config.json + model.safetensors
+ the tokenizer record, see pretrained.py) that `transformers.GPT2LMHeadModel.from_pretrained(DIR)`
loads.

A snapshot written by any strategy (ddp, zero, fsdp, tp, pp, meshes) stores parameters under
their plain names, sharded by DCP. Here one process, with no process group, builds the model
from the snapshot's recorded config and lets DCP reassemble every shard into it. The result
loads with `torch.load(..., weights_only=True)`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from config import UsageError
from model import GPT, GPTConfig
from snapshots.pretrained import write_hf
from snapshots.reader import UnsafeSnapshot
from snapshots.store import (
    SnapshotMeta,
    list_snapshots,
    load_tensors,
    other_format_refusal,
    step_dir_name,
    validate_snapshot,
)


def consolidate(run_dir: Path, step: int | None) -> dict:
    """The model.pt payload from the snapshot at `step` (None: the newest valid one)."""
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
        gpt_cfg = GPTConfig(**meta.model_config)
        model = GPT(gpt_cfg)
        sd = {k: v for k, v in model.state_dict().items()}
        state = {"model": sd}
        try:  # tensors only, through the restricted reader: nothing in the snapshot is unpickled
            load_tensors(path, state)
        except UnsafeSnapshot as e:  # changed since validate_snapshot read it
            raise UsageError(f"snapshot {path} is unsafe to load ({e}); pick another --step") from None
        model.load_state_dict(state["model"])
        return meta.model_file({k: v.detach().clone() for k, v in model.state_dict().items()})
    raise UsageError(f"no valid snapshot in {run_dir / 'snapshots'}; every one is damaged")


def model_step_path(run_dir: Path, step: int) -> Path:
    """Where an export of an older step goes: beside model.pt, never over it."""
    return run_dir / f"model_{step_dir_name(step)}.pt"


def _step_of(model_pt: Path) -> int | None:
    """The step a model.pt holds (None: there is none, or it is not readable)."""
    try:
        return int(torch.load(model_pt, map_location="cpu", weights_only=True, mmap=True)["step"])
    except Exception:
        return None


def default_out(run_dir: Path, step: int, step_asked: bool) -> tuple[Path, str]:
    """(path, note) of a pt export without --out. model.pt is the run's final model: an export
    writes it only for the newest snapshot and only when model.pt holds no later step; any other
    step goes to model_step_<N>.pt, and the note says model.pt was left as it is."""
    final = run_dir / "model.pt"
    final_step = _step_of(final) if final.exists() else None
    if not step_asked and (final_step is None or final_step <= step):
        return final, ""
    kept = f" ({final}, step {final_step}, is left as it is)" if final_step is not None else ""
    return model_step_path(run_dir, step), kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, help="the run folder (trainer.run_dir)")
    ap.add_argument("--step", type=int, default=None, help="snapshot step (default: newest valid)")
    ap.add_argument("--format", choices=("pt", "hf"), default="pt",
                    help="pt: model.pt (default); hf: a Hugging Face GPT-2 folder (needs --out)")
    ap.add_argument("--out", default=None, help="output path (default: <run-dir>/model.pt for the newest "
                    "snapshot, <run-dir>/model_step_<N>.pt for --step N or when model.pt holds a later "
                    "step; a folder with --format hf)")
    args = ap.parse_args(argv)
    try:
        if args.format == "hf" and not args.out:
            raise UsageError("--format hf writes a folder: name it with --out DIR")
        run_dir = Path(args.run_dir)
        payload = consolidate(run_dir, args.step)
        if args.format == "hf":
            write_hf(payload, Path(args.out))
            print(f"wrote {args.out} (Hugging Face GPT-2) from step {payload['step']}")
            return 0
        out, note = (Path(args.out), "") if args.out else default_out(run_dir, payload["step"], args.step is not None)
        tmp = out.with_name(out.name + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(out)
        print(f"wrote {out} from step {payload['step']}{note}")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    sys.exit(main())
