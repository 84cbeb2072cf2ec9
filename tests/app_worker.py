"""Run under torchrun by tests/test_data_parallel.py: the whole app (`main.main`, exactly what
`torchrun main.py ...` runs) once per `--app "OVERRIDES"`, several runs in ONE launch (imports
cost 7-9 s per launch). The process group is kept between runs (main(keep_process_group=True);
init_distributed reuses the live group). Rank 0 writes each run's exit code to
OUT/exit_codes.json."""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

import main as app  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--app", action="append", required=True, help="space-separated overrides")
    args = ap.parse_args()
    # a refused run here is followed by the next one, not by the worker's exit: no error file for
    # torchrun's summary (main's handler would also make ranks > 0 wait for rank 0 to exit first)
    os.environ.pop("TORCHELASTIC_ERROR_FILE", None)
    codes = []
    for overrides in args.app:
        codes.append(app.main(overrides.split(), keep_process_group=True))  # one group for all runs
        dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out, "exit_codes.json").write_text(json.dumps(codes))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
