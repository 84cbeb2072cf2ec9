"""Run under torchrun by the parity tests: for each `--case NAME OVERRIDES` train K steps with
`harness.run_steps` and (rank 0) save the result to OUT/NAME.pt. Cases share one process group,
so one launch (7-9 s of imports) covers several strategies."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness import run_steps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--case", nargs=2, action="append", metavar=("NAME", "OVERRIDES"), required=True,
                    help="case name and space-separated overrides")
    args = ap.parse_args()
    out = Path(args.out)
    for name, overrides in args.case:
        result = run_steps(overrides.split(), args.steps, out / f"run-{name}")
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
