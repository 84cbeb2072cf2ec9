"""Shared by the tests: the corpus location, the tiny test config, launching torchrun, and
running K training steps of one configuration (in this process or under torchrun).

The device of the whole suite is one switch, the environment variable MINGPT_TEST_DEVICE: `cpu`
(the default, what CI runs: gloo between ranks) or `cuda` (the same tests on GPUs, NCCL between
ranks, one GPU per rank). tests/conftest.py refuses a cuda session on a machine with fewer than
SUITE_GPUS GPUs, and `torchrun()` refuses a launch with more ranks than GPUs.

Multi-process launches take a machine-wide file lock, so two of them never share the 2 cores
(pytest-xdist workers or several checkouts included), and always run with a short process-group
timeout and a wall-clock timeout so a dead peer fails the test instead of hanging it.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
CORPUS = SHARED / "data" / "tinyshakespeare.txt"
TIKTOKEN_DIR = SHARED / "data" / "tiktoken"
LOCK = Path(os.environ.get("MINGPT_TEST_LOCK", "/tmp/mingpt-parallel-multiprocess.lock"))

DEVICE_ENV = "MINGPT_TEST_DEVICE"
TEST_DEVICE = os.environ.get(DEVICE_ENV, "cpu")
# The widest launches of the suite have 8 ranks (test_default_config, the 2x2x2 mesh of
# test_mesh_2x2x2); NCCL refuses two ranks on one GPU, so a cuda session needs 8 GPUs.
SUITE_GPUS = 8


def device_problem(device: str = TEST_DEVICE) -> str | None:
    """Why the suite cannot run on `device` (MINGPT_TEST_DEVICE) here; None when it can."""
    if device not in ("cpu", "cuda"):
        return f"{DEVICE_ENV}={device} is not one of cpu, cuda"
    gpus = torch.cuda.device_count() if device == "cuda" and torch.cuda.is_available() else 0
    if device == "cuda" and gpus < SUITE_GPUS:
        return (f"{DEVICE_ENV}=cuda runs the suite on {SUITE_GPUS} GPUs (one per rank of its 8-rank launches, "
                f"NCCL) but torch {torch.__version__} sees {gpus}: run it on a machine with {SUITE_GPUS} GPUs, "
                f"or unset {DEVICE_ENV} to run it on the CPU")
    return None


def device_overrides(device: str = TEST_DEVICE) -> list[str]:
    """Config overrides of every test run on `device`. On cpu none: trainer.device stays `auto`,
    which finds no GPU (device_env hides them), so a cpu session is CI's run on any machine."""
    return [f"trainer.device={device}"] if device == "cuda" else []


def device_env(device: str = TEST_DEVICE) -> dict[str, str]:
    """Environment of every process of the suite on `device`.

    cuda: NVIDIA_TF32_OVERRIDE=0, NVIDIA's switch that keeps cuBLAS and cuDNN from running fp32
    matmuls as TF32, which the app honours too (perf.set_fp32_matmul_mode then leaves torch's TF32
    flags off): the parity tests compare fp32 runs to 1e-5, and TF32 rounds matmul inputs to ~5e-4.
    cpu: no visible GPU, so that trainer.device `auto` (every test's on cpu) picks the CPU on a
    GPU machine too."""
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
# How main.py's start-up line names global rank 0's device ("| device cpu").
SHOWN_DEVICE = "cuda:0" if TEST_DEVICE == "cuda" else "cpu"


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MINGPT_PG_TIMEOUT="60", PYTHONUNBUFFERED="1",
               TIKTOKEN_CACHE_DIR=str(TIKTOKEN_DIR), WANDB_MODE="offline", WANDB_SILENT="true",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    env.pop("WANDB_API_KEY", None)
    env.update(device_env())
    env.update({k: str(v) for k, v in extra.items()})
    return env


@contextmanager
def multiprocess_lock():
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def torchrun(nproc: int, script_and_args: list[str], timeout: float = 300, cwd: Path = REPO,
             extra_torchrun: list[str] = (), **env) -> subprocess.CompletedProcess:
    if TEST_DEVICE == "cuda" and nproc > torch.cuda.device_count():
        raise RuntimeError(f"this launch has {nproc} ranks and NCCL needs one GPU per rank, but torch sees "
                           f"{torch.cuda.device_count()} GPUs: run it on a machine with {nproc} or more "
                           f"(the whole suite: {SUITE_GPUS})")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *extra_torchrun, *script_and_args]
    with multiprocess_lock():
        return subprocess.run(cmd, cwd=cwd, env=child_env(**env), capture_output=True, text=True,
                              timeout=timeout)


def python(args: list[str], timeout: float = 300, cwd: Path = REPO, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=child_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def run_steps(overrides: list[str], steps: int, run_dir: Path, memory_at_step: int = 1,
              evaluate: bool = False) -> dict:
    """Train `steps` steps of TINY + overrides in this process's launch (single process or one
    rank of torchrun). Returns losses (dp-mean, every step), the pre-clip gradient norm of every
    step (what metrics.jsonl logs as grad_norm), first-step gradients (whole, by name), the
    whole parameters after the last step (on rank 0; None on other ranks), each rank's resident
    bytes after the backward of step `memory_at_step`, and with `evaluate` the validation loss
    after the last step (Trainer.evaluate)."""
    import torch.distributed as dist

    from config import load_config
    from launch.build import build_trainer
    from parallel.env import init_distributed

    cfg = load_config(None, TINY + [f"trainer.run_dir={run_dir}"] + list(overrides))
    env = init_distributed(cfg)
    trainer = build_trainer(cfg, env, run_dir)
    s = trainer.strategy
    losses, norms, grads, memory, first_params = [], [], None, None, None
    for step in range(steps):
        loss = trainer.forward_backward()
        if step == 0:
            grads = s.full_grad_dict()
        if step == memory_at_step:
            mine = s.resident_bytes(trainer.optimizer)
            memory = [mine]
            if env.distributed:
                memory = [None] * env.world_size
                dist.all_gather_object(memory, mine)
        norms.append(float(trainer.optimizer_step()))
        losses.append(float(s.reduce_mean(loss)))
        if step == 0:
            first_params = _floats(s.full_model_state_dict())  # collective
    result = {"losses": losses, "grad_norms": norms, "grads": grads, "memory": memory,
              "first_params": first_params, "params": _floats(s.full_model_state_dict()),
              "world": env.world_size, "num_params": trainer.model_cost.num_params, "dp": s.dp_size}
    if evaluate:
        result["val_loss"] = trainer.evaluate()
    return result


def _floats(state: dict | None) -> dict | None:
    """Strategy.full_model_state_dict() (whole tensors on rank 0, None elsewhere) as fp32."""
    return state and {k: v.float() for k, v in state.items()}


def save_cases(cases: list[tuple[str, str]], steps: int, out: Path, **run_kwargs) -> None:
    """For a torchrun worker: run each (name, "overrides") case with run_steps in this launch's
    process group and save rank 0's result to OUT/NAME.pt."""
    import torch.distributed as dist

    for name, overrides in cases:
        result = run_steps(overrides.split(), steps, out / f"run-{name}", **run_kwargs)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
        dist.barrier()


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
