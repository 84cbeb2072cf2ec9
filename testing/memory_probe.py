"""Each worker's peak host memory at two moments of a real launch, read from outside while it is
stopped: when the model is built and after the first optimizer step. benchmarks/construction_memory.py
prints them per layout; tests/test_construction_memory.py asserts them.

Every worker stops itself at both moments (MINGPT_FAULT's `stop` at the `train` and `update` hook
points, testing/faults.py), is read while stopped (its VmHWM: observe/host_memory.py), and is
continued: the readings do not race the training.
"""
from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from observe.host_memory import peak_rss
from testing.local import TIKTOKEN_DIR, torchrun_argv, worker_pids, worker_rank


def peaks(agent_pid: int) -> dict[int, int]:
    """Each worker's VmHWM by its rank."""
    return {worker_rank(pid): peak_rss(pid) for pid in worker_pids(agent_pid)}


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def measure(repo: Path, nproc: int, overrides: list[str], timeout: float = 900, **env_extra: str) -> dict[str, dict[int, int]]:
    """{"built": {rank: VmHWM when the model is built}, "step": {... after the first optimizer step}}.
    Every worker stops itself at both moments (MINGPT_FAULT's `stop` at the `train` and `update`
    hook points), is read while stopped, and is continued: the readings do not race the training.
    A commit without the `train` point is read when rank 0 prints the start-up view instead
    (the workers may then be into their first step)."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as run_dir:  # killed workers may still be writing
        faults = ",".join(f"stop:train:0:{r},stop:update:1:{r}" for r in range(nproc))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TIKTOKEN_CACHE_DIR=str(TIKTOKEN_DIR),
                   WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join([str(repo / "testing" / "boot"), str(repo)]), CUDA_VISIBLE_DEVICES="", MINGPT_FAULT=faults,
                   **env_extra)
        has_train_point = '"train"' in (repo / "observe" / "hooks.py").read_text() \
            if (repo / "observe" / "hooks.py").is_file() else False
        argv = torchrun_argv(nproc, ["main.py", *overrides, f"trainer.run_dir={run_dir}/run"])
        proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        found: dict[str, dict[int, int]] = {}
        output: list[str] = []
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and len(found) < 2 and proc.poll() is None:
                if sel.select(timeout=0.2):
                    line = proc.stdout.readline()
                    output.append(line)
                    if line.startswith("run: ") and not has_train_point:
                        found["built"] = peaks(proc.pid)
                pids = worker_pids(proc.pid)
                if len(pids) == nproc and all(stopped(p) for p in pids):
                    found["built" if has_train_point and "built" not in found else "step"] = peaks(proc.pid)
                    for p in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p, signal.SIGCONT)
        finally:
            # torchrun starts each worker in a session of its own: killing the agent's group would
            # leave them running, writing a run folder (GBs) after the temporary one is removed
            workers = worker_pids(proc.pid)
            for p in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            gone_by = time.monotonic() + 30  # reaped by init once the agent is gone
            while any(Path(f"/proc/{p}").exists() for p in workers) and time.monotonic() < gone_by:
                time.sleep(0.05)
        if len(found) < 2:
            raise RuntimeError(f"the launch ended before both readings ({sorted(found)}):\n{''.join(output[-20:])}")
        return found


