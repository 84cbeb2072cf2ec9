"""Run by tests/test_weights_out.py: how much host memory writing a model's weights costs the
writing process, above what it held before. Prints one line per process, `WRITE_PEAK {json}`:
its peak resident bytes above its resident set when the phase began (the peak is reset there:
observe/host_memory.py); under torchrun each rank writes its line to DIR/write_peak_<rank>.json
instead (two ranks printing at once can merge their lines).

    python tests/write_peak_worker.py export RUN_DIR pt|hf OUT       # export.py of RUN_DIR's newest snapshot
    torchrun ... tests/write_peak_worker.py finish DIR OVERRIDES...  # a run; the end of it (model.pt) measured
"""
import json
import os
import sys
from pathlib import Path

import export
import main as main_py
from launch import app
from observe.host_memory import peak_rss, reset_peak, rss


def measured(fn, *args):
    """fn(*args), and the peak resident bytes it added above the resident set it started with."""
    reset_peak()
    before = rss()
    result = fn(*args)
    return result, peak_rss() - before


def report(what: str, above: int, out: Path | None = None) -> None:
    rank = int(os.environ.get("RANK", 0))
    line = json.dumps({"what": what, "rank": rank, "above": above})
    if out is None:
        print("WRITE_PEAK " + line, flush=True)
    else:
        (out / f"write_peak_{rank}.json").write_text(line)


def main(argv: list[str]) -> int:
    if argv[0] == "export":
        run_dir, fmt, out = argv[1:4]
        code, above = measured(export.main, ["--run-dir", run_dir, "--format", fmt, "--out", out])
        report(f"export {fmt}", above)
        return code
    real = app._finish

    def finish(*args):
        report("finish", measured(real, *args)[1], Path(argv[1]))
    app._finish = finish
    return main_py.main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
