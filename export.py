"""Consolidate a snapshot into a plain model.pt: `python export.py --run-dir runs/<name> [--step N]`.

The newest snapshot goes to `<run-dir>/model.pt`; `--step N` (or a model.pt that holds a later
step than the snapshot) writes `<run-dir>/model_step_<N>.pt` instead, so an older export never
replaces the run's final model. `sample.py --model FILE` and `model.init_from=FILE` read either.

`--format hf --out DIR` writes a Hugging Face GPT-2 folder instead (config.json + model.safetensors
+ the tokenizer record, see weights/pretrained.py) that `transformers.GPT2LMHeadModel.from_pretrained(DIR)`
loads.

Any layout's snapshot is reassembled in this one process (weights/consolidate.py); the result
loads with `torch.load(..., weights_only=True)`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from config import UsageError
from observe.host_memory import return_large_frees
from snapshots.format import step_dir_name
from storage.failures import STORAGE_EXIT, error_words, fix_for, os_error_in
from weights.consolidate import consolidate
from weights.model_file import MODEL_FILE, read_model_file, write_model_file
from weights.pretrained import write_hf


def model_step_path(run_dir: Path, step: int) -> Path:
    """Where an export of an older step goes: beside model.pt, never over it."""
    return run_dir / f"model_{step_dir_name(step)}.pt"


def _step_of(model_pt: Path) -> int | None:
    """The step a model.pt holds (None: there is none, or it is not readable)."""
    try:
        return read_model_file(model_pt, mmap=True).step
    except UsageError:
        return None


def default_out(run_dir: Path, step: int, step_asked: bool) -> tuple[Path, str]:
    """(path, note) of a pt export without --out. model.pt is the run's final model: an export
    writes it only for the newest snapshot and only when model.pt holds no later step; any other
    step goes to model_step_<N>.pt, and the note says model.pt was left as it is."""
    final = run_dir / MODEL_FILE
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
    return_large_frees()  # each tensor written is returned to the kernel when dropped
    try:
        if args.format == "hf" and not args.out:
            raise UsageError("--format hf writes a folder: name it with --out DIR")
        run_dir = Path(args.run_dir)
        model_file = consolidate(run_dir, args.step)
        if args.format == "hf":
            out, note = Path(args.out), " (Hugging Face GPT-2)"
            write, left = (lambda: write_hf(model_file, out)), "each of its files is whole or absent"
        else:
            out, note = (Path(args.out), "") if args.out else default_out(run_dir, model_file.step, args.step is not None)
            write, left = (lambda: write_model_file(out, model_file)), "nothing was written"
        try:
            write()
        except Exception as e:  # every file is written whole or not at all
            if (cause := os_error_in(e)) is None:  # torch.save wraps a failed write in a RuntimeError
                raise
            print(f"error: cannot write {out} ({error_words(cause)}); {left}; "
                  f"{fix_for(cause, out if args.format == 'hf' else out.parent)} and run this command again",
                  file=sys.stderr)
            return STORAGE_EXIT
        print(f"wrote {out}{note if args.format == 'hf' else ''} from step {model_file.step}"
              f"{note if args.format == 'pt' else ''}")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    sys.exit(main())
