"""What the tests share beyond testing/local.py (launching local processes under torchrun with the
machine-wide lock, the tiny config, the device switch; shared with benchmarks/) and testing/parity.py
(K steps of a layout against one process):

- the suite's device check: a cuda session needs a GPU (tests/conftest.py refuses one without);
  it runs every launch that fits its GPUs and lists the ones it left out (one GPU per NCCL rank);
  with fewer before any test runs);
- training in this process through main.main (`app_in_process`);
- reading what a run folder holds: metrics rows, logged steps, model.pt's tensors;
- the skeleton of every torchrun worker script (tests/*_worker.py): `run_worker`;
- a launch the fault tests watch and signal while it runs: `StreamedLaunch`;
- a clean checkout of the repository (its tracked files) for the README's commands: `clean_checkout`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch

from testing.local import DEVICE, DEVICE_ENV, REPO, child_env, multiprocess_lock

# How main.py's start-up line names global rank 0's device ("| device cpu").
SHOWN_DEVICE = "cuda:0" if DEVICE == "cuda" else "cpu"


def device_problem(device: str = DEVICE) -> str | None:
    """Why the suite cannot run on `device` (MINGPT_TEST_DEVICE) here; None when it can. A cuda
    session on fewer GPUs than a launch's ranks runs the rest and leaves that launch out, by name
    (testing/local.py NotEnoughGPUs, tests/conftest.py)."""
    if device not in ("cpu", "cuda"):
        return f"{DEVICE_ENV}={device} is not one of cpu, cuda"
    gpus = torch.cuda.device_count() if device == "cuda" and torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        return (f"{DEVICE_ENV}=cuda runs the suite on this machine's GPUs but torch {torch.__version__} sees none: "
                f"run it on a machine with a GPU, or unset {DEVICE_ENV} to run it on the CPU")
    return None


# ----------------------------------------------------------------------------- runs in this process


def app_in_process(base: list[str]) -> Callable[..., int]:
    """`train(run_dir, *overrides)`: main.main(base + trainer.run_dir + overrides) in this process,
    what `python main.py ...` runs; returns its exit code."""
    def train(run_dir: Path, *extra: str) -> int:
        import main

        return main.main([*base, f"trainer.run_dir={run_dir}", *extra])
    return train


def metric_rows(run_dir: Path) -> list[dict]:
    """The rows of `run_dir`/metrics.jsonl, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def metric_steps(run_dir: Path) -> list[int]:
    """The step of every row of `run_dir`/metrics.jsonl, in order."""
    return [row["step"] for row in metric_rows(run_dir)]


def model_tensors(run_dir: Path) -> dict:
    """The model's tensors in `run_dir`/model.pt, by name."""
    return torch.load(run_dir / "model.pt", weights_only=True)["model"]


# ----------------------------------------------------------------------------- torchrun workers


def run_worker(body: Callable[[argparse.Namespace], None],
               options: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """The skeleton of every tests/*_worker.py, run under torchrun (PYTHONPATH from
    testing.local.child_env makes the repository importable): parse the common arguments and the
    worker's own (`options(parser)`), run `body(args)`, then end the process group.

    Common arguments: --out FOLDER (rank 0 writes its results there), --steps K (default 10),
    --case NAME "OVERRIDES" and --app "OVERRIDES" (both repeatable; `args.case` is a list of
    (name, overrides) pairs, `args.app` a list of override strings).

    The error file: TORCHELASTIC_ERROR_FILE is dropped before the body. A worker runs several cases
    or app runs in one launch, and a refused app run (main.main writes its one line to that file,
    ranks > 0 after waiting for rank 0 to write first) is followed by the next run, not by the
    worker's exit. A failure of the worker itself still ends the launch, with its traceback on
    stderr."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path, help="folder of rank 0's results")
    ap.add_argument("--steps", type=int, default=10, help="training steps of each --case")
    ap.add_argument("--case", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"))
    ap.add_argument("--app", action="append", default=[], help="space-separated main.py overrides")
    if options is not None:
        options(ap)
    args = ap.parse_args()
    os.environ.pop("TORCHELASTIC_ERROR_FILE", None)
    body(args)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def run_apps(apps: list[str], codes_file: Path) -> None:
    """The whole app (main.main, what `torchrun main.py ...` runs) once per "overrides" in this
    launch, keeping its process group between runs (init_distributed reuses the live group); rank 0
    writes the exit codes to `codes_file`."""
    import torch.distributed as dist

    import main

    if not apps:
        return
    codes = []
    for overrides in apps:
        codes.append(main.main(overrides.split(), keep_process_group=True))  # one group for all runs
        dist.barrier()
    if dist.get_rank() == 0:
        codes_file.write_text(json.dumps(codes))


class StreamedLaunch:
    """`cmd` (torchrun or `python main.py`) run in a session of its own, as a shell runs a job,
    while this process holds the machine-wide lock; its stdout and stderr are read line by line on a
    thread into `lines`, so a test can act on what it prints while it runs. On leaving the `with`
    block whatever of the session still runs (torchrun, its workers, a stopped one) is SIGKILLed.

        with StreamedLaunch(cmd, MINGPT_FAULT=...) as job:
            assert job.wait_for(lambda: "step " in job.output()), job.output()
            os.kill(...)
            rc = job.proc.wait(timeout=200)
        out = job.output()
    """

    def __init__(self, cmd: list[str], **env):
        self.cmd, self.env, self.lines = cmd, env, []

    def __enter__(self) -> "StreamedLaunch":
        self._held = ExitStack()
        self._held.enter_context(multiprocess_lock())
        try:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=child_env(**self.env), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        except BaseException:
            self._held.close()
            raise
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                        daemon=True)
        self._reader.start()
        return self

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, ready: Callable[[], bool], timeout: float = 120) -> bool:
        """Poll until `ready()` holds (True), or the launch ended or `timeout` passed (False)."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def __exit__(self, *exc) -> None:
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self._reader.join(timeout=10)
        finally:
            self._held.close()  # the lock


def clean_checkout(dest: Path) -> Path:
    """A copy of the repository's tracked files at `dest`, as a fresh clone has them (no runs/, no
    caches): where the README's commands run, so their outputs land there. Starts git."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in filter(None, files.stdout.split("\0")):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    return dest

