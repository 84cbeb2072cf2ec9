"""Run under torchrun by tests/test_tp_pp.py (and in-process for the one-process reference).

`--case NAME "OVERRIDES"`: train K steps of TINY + overrides and record what parity needs: the
dp-mean loss of every step, the first step's whole gradients by name, and the validation loss
after the last step (Trainer.evaluate: under pp it runs the schedule's forward-only pass and the
loss comes from the last stage). Rank 0 saves OUT/NAME.pt.
`--app "OVERRIDES"`: the whole app (main.main, what `torchrun main.py ...` runs) in the same
launch; rank 0 writes the exit codes to OUT/app_exit_codes.json.
All cases and runs share one process group, so one launch pays the imports once."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402

from harness import run_steps, save_cases  # noqa: E402


def run_case(overrides: list[str], steps: int, run_dir: Path) -> dict:
    """harness.run_steps plus the validation loss after the last step."""
    return run_steps(overrides, steps, run_dir, evaluate=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--case", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"))
    ap.add_argument("--app", action="append", default=[], help="space-separated main.py overrides")
    args = ap.parse_args()
    out = Path(args.out)
    save_cases(args.case, args.steps, out, evaluate=True)
    import main as app
    codes = []
    for overrides in args.app:
        codes.append(app.main(overrides.split(), keep_process_group=True))  # one group for all runs
        dist.barrier()
    if dist.get_rank() == 0 and args.app:
        (out / "app_exit_codes.json").write_text(json.dumps(codes))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
