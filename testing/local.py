"""Launch local processes under torchrun with the machine-wide lock: what the tests and the
benchmarks share to run N ranks on this machine.

- The data beside the repository (../shared/data): the Tiny Shakespeare corpus and tiktoken's
  GPT-2 BPE ranks, so nothing goes online.
- TINY, a config small enough that a step takes milliseconds.
- The device of every local launch, one switch: the environment variable MINGPT_TEST_DEVICE,
  `cpu` (the default, what CI runs: GPUs hidden, gloo between ranks) or `cuda` (NCCL, one GPU
  per rank). `torchrun()` refuses a cuda launch with more ranks than GPUs.
- `torchrun_argv`, the one torchrun command line, and `torchrun`, which runs it holding a
  machine-wide file lock (so two multi-process launches never share the cores or the loopback
  interface, whichever checkout or pytest worker starts them), with a short process-group timeout
  and a wall-clock timeout so that a dead peer fails the launch instead of hanging it.
- `benchmark_main`, the command line of a benchmark that relaunches itself under torchrun.
- `worker_pids`, `worker_rank` and `rank_pid`: a launch's workers and their ranks, for the tests
  that signal or pin one of them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

from config import UsageError
from launch.errors import reject_dashed_overrides
from tools.processes import child_env as base_child_env
from tools.processes import multiprocess_lock

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
CORPUS = SHARED / "data" / "tinyshakespeare.txt"
TIKTOKEN_DIR = SHARED / "data" / "tiktoken"
FAULT_BOOT = REPO / "testing" / "boot"  # sitecustomize.py: installs MINGPT_FAULT's faults in every child
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # what the `torchrun` script runs

DEVICE_ENV = "MINGPT_TEST_DEVICE"
DEVICE = os.environ.get(DEVICE_ENV, "cpu")


class NotEnoughGPUs(RuntimeError):
    """A cuda launch with more ranks than this machine has GPUs (the test suite leaves it out, by name)."""


def device_overrides(device: str = DEVICE) -> list[str]:
    """Config overrides of every local run on `device`. On cpu none:
    trainer.device stays `auto`, which finds no GPU (device_env hides them), so a cpu run is CI's
    run on any machine."""
    return [f"trainer.device={device}"] if device == "cuda" else []


def device_env(device: str = DEVICE) -> dict[str, str]:
    """Environment of every local process on `device`.

    cuda: NVIDIA_TF32_OVERRIDE=0, NVIDIA's switch that keeps cuBLAS and cuDNN from running fp32
    matmuls as TF32, which the app honours too (perf.set_fp32_matmul_mode then leaves torch's TF32
    flags off): the parity checks compare fp32 runs to 1e-5, and TF32 rounds matmul inputs to ~5e-4.
    cpu: no visible GPU, so that trainer.device `auto` picks the CPU on a GPU machine too."""
    return {"NVIDIA_TF32_OVERRIDE": "0"} if device == "cuda" else {"CUDA_VISIBLE_DEVICES": ""}


# A model small enough that a step takes milliseconds, big enough to have every kind of layer:
# 4 blocks (pp=2 x 2 stages per rank), 4 heads (tp=2 or 4), micro-batches (accumulation 2 at dp=2).
TINY = [
    f"data.path={CORPUS}", "data.truncate=200000", "model.n_layer=4", "model.n_head=4",
    "model.n_embd=32", "model.block_size=16", "trainer.batch_size=8", "trainer.micro_batch_size=2",
    "trainer.eval_every=5", "trainer.eval_batches=2", "trainer.log_every=5", "trainer.save_every=0",
    "trainer.sample_tokens=20", "optimizer.warmup_steps=2", "wandb.enabled=false",
    *device_overrides(),
]


def child_env(**extra) -> dict:
    """The environment of a local child process (tools/processes.py's: one thread, a 60 s
    process-group timeout, the repository importable) with offline tiktoken and wandb, the device's
    variables, the test faults' boot folder (FAULT_BOOT) on PYTHONPATH, and `extra`."""
    env = base_child_env(TIKTOKEN_CACHE_DIR=str(TIKTOKEN_DIR), WANDB_MODE="offline", WANDB_SILENT="true")
    env["PYTHONPATH"] = str(FAULT_BOOT) + os.pathsep + env["PYTHONPATH"]
    env.pop("WANDB_API_KEY", None)
    env.update(device_env())
    env.update({k: str(v) for k, v in extra.items()})
    return env


def need_gpus(ranks: int) -> None:
    """Raise NotEnoughGPUs when a cuda session's launch of `ranks` ranks has fewer GPUs than ranks
    (NCCL needs one GPU per rank); nothing on the CPU, where every launch fits."""
    if DEVICE == "cuda" and ranks > torch.cuda.device_count():
        raise NotEnoughGPUs(f"this launch has {ranks} ranks and NCCL needs one GPU per rank, but torch sees "
                            f"{torch.cuda.device_count()} GPUs: run it on a machine with {ranks} or more")


def torchrun_argv(nproc: int, args: list[str], extra_torchrun: list[str] = (),
                     standalone: bool = True) -> list[str]:
    """`torchrun [--standalone] --nproc_per_node=N EXTRA... ARGS...` as this interpreter runs it."""
    return [*TORCHRUN, *(["--standalone"] if standalone else []), f"--nproc_per_node={nproc}",
            *extra_torchrun, *args]


def torchrun(nproc: int, script_and_args: list[str], timeout: float = 300, cwd: Path = REPO,
             extra_torchrun: list[str] = (), **env) -> subprocess.CompletedProcess:
    """Run `script_and_args` on `nproc` local ranks, holding the machine-wide lock; output captured.
    A launch that outlives `timeout` seconds is killed (subprocess.TimeoutExpired)."""
    need_gpus(nproc)
    with multiprocess_lock():
        return subprocess.run(torchrun_argv(nproc, script_and_args, extra_torchrun), cwd=cwd,
                              env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def python(args: list[str], timeout: float = 300, cwd: Path = REPO, **env) -> subprocess.CompletedProcess:
    """`python ARGS...` in the local child environment (no lock: one process), output captured."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=child_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def worker_pids(parent_pid: int) -> list[int]:
    """PIDs of the processes whose parent is `parent_pid` (torchrun's agent -> its workers)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # field 4 is the ppid; the command name (field 2) may contain spaces, so split after ')'
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent_pid:
            pids.append(int(d.name))
    return pids


def worker_rank(pid: int) -> int | None:
    """The RANK a torchrun worker was started with (its environment), or None once it is gone."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
    return found[0] if found else None


def rank_pid(agent_pid: int, rank: int) -> int:
    """The PID of the worker of `rank` under torchrun's agent `agent_pid`."""
    for pid in worker_pids(agent_pid):
        if worker_rank(pid) == rank:
            return pid
    raise LookupError(f"no worker of rank {rank} under {agent_pid}")


def torchrun_until(nproc: int, args: list[str], timeout_s: int, capture: bool = False,
                   **env) -> subprocess.CompletedProcess:
    """A benchmark's measuring launch: `args` on `nproc` local ranks holding the machine-wide lock,
    under coreutils `timeout` (after `timeout_s` seconds torchrun gets SIGTERM, which stops its
    workers, and the exit status is 124). The benchmark's own TIKTOKEN_CACHE_DIR is kept (the
    shared copy is only the default); output streams through unless `capture`."""
    env.setdefault("TIKTOKEN_CACHE_DIR", os.environ.get("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_DIR)))
    with multiprocess_lock():
        return subprocess.run(["timeout", str(timeout_s), *torchrun_argv(nproc, args)], cwd=REPO,
                              env=child_env(**env), capture_output=capture, text=True)


def benchmark_main(doc: str, script: str, worker: Callable[[list[str]], None], timeout_s: int) -> None:
    """The command line of a benchmark that measures under torchrun. As a torchrun worker (RANK is
    set) it runs `worker(overrides)`; otherwise it parses `[--nproc N] [overrides...]` (bad input:
    one line, exit 2) and runs `script` under torchrun on this machine (torchrun_until: the
    machine-wide lock, so no other launch shares the cores or the loopback interface); exits with
    torchrun's code."""
    if "RANK" in os.environ:
        worker(sys.argv[1:])
        return
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (processes) to measure (default: 2)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.n_layer=8")
    try:
        reject_dashed_overrides(sys.argv[1:])
    except UsageError as e:
        ap.exit(2, f"error: {e}\n")
    args = ap.parse_args()
    sys.exit(torchrun_until(args.nproc, [script, *args.overrides], timeout_s).returncode)
