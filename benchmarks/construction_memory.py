"""Each worker's peak host memory when the model is built, and through the first step, per layout.

    python benchmarks/construction_memory.py                       # the default cases (minutes)
    python benchmarks/construction_memory.py --case fsdp 8 parallel.strategy=fsdp
    python benchmarks/construction_memory.py --repo ../old-checkout # the same cases on another commit

Every case is a real `torchrun main.py` launch of a 16 x 1024 GPT (201M parameters, 805 MB in
fp32) and of a tiny one (2 x 64) with the same layout and process count, read from outside: each
worker's VmHWM (/proc/PID/status, its peak resident set) when the model is built and after the
first optimizer step (each worker stops itself there: MINGPT_FAULT's `stop` at the hook points
`train` and `update`, testing/faults.py). The table gives, per case, the largest worker's peak above the tiny launch's, as a
fraction of the whole model's fp32 bytes: what the model itself costs a rank. The layouts promise
(fp32 AdamW, n ranks sharding): ddp 1x the model and 1x of gradient buckets at construction, 4x
through a step; fsdp and zero-3 1/n and 4/n (plus the gathered blocks); tp=2 and pp=2 about 1/2
and 2. A commit before the `train` hook point is read at its start-up view instead, which may
race its first step.

It runs the commit it is in (or --repo's): the figures before and after a change come from two runs.
CPU flags are printed beside the figures (they do not change memory, but the guide asks for them).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testing.local import CORPUS, TIKTOKEN_DIR, multiprocess_lock, torchrun_argv, worker_pids, worker_rank  # noqa: E402

MODEL = ["model.n_layer=16", "model.n_head=16", "model.n_embd=1024"]
TINY_MODEL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64"]  # 2 blocks: pp=2 needs one per stage
MODEL_BYTES = 4 * (16 * (12 * 1024 * 1024 + 13 * 1024) + (65 + 64) * 1024 + 2 * 1024)  # fp32, char vocab 65
COMMON = [f"data.path={CORPUS}", "data.truncate=200000", "model.block_size=64", "trainer.batch_size=8",
          "trainer.micro_batch_size=1", "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0",
          "trainer.save_every=0", "trainer.sample_tokens=0", "wandb.enabled=false", "trainer.hang_timeout_s=0",
          "optimizer.warmup_steps=1"]
CASES = [("fsdp x8", 8, ["parallel.strategy=fsdp"]), ("zero-3 x8", 8, ["parallel.strategy=zero", "parallel.zero_stage=3"]),
         ("hsdp 2x2", 4, ["parallel.strategy=fsdp", "parallel.dp_replicate=2"]),
         ("tp=2", 2, ["parallel.strategy=none", "parallel.tp=2"]), ("pp=2", 2, ["parallel.strategy=none", "parallel.pp=2"]),
         ("ddp x2", 2, ["parallel.strategy=ddp"])]


def vm_hwm(pid: int) -> int:
    """Peak resident bytes of a live process (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(re.search(r"^VmHWM:\s+(\d+) kB", text, re.M).group(1)) * 1024


def peaks(agent_pid: int) -> dict[int, int]:
    """Each worker's VmHWM by its rank."""
    return {worker_rank(pid): vm_hwm(pid) for pid in worker_pids(agent_pid)}


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def measure(repo: Path, nproc: int, overrides: list[str], timeout: float = 900) -> dict[str, dict[int, int]]:
    """{"built": {rank: VmHWM when the model is built}, "step": {... after the first optimizer step}}.
    Every worker stops itself at both moments (MINGPT_FAULT's `stop` at the `train` and `update`
    hook points), is read while stopped, and is continued: the readings do not race the training.
    A commit without the `train` point is read when rank 0 prints the start-up view instead
    (the workers may then be into their first step)."""
    # testing/boot installs the faults in each worker (an older commit's launch/app.py did it itself)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as run_dir:  # killed workers may still be writing
        faults = ",".join(f"stop:train:0:{r},stop:update:1:{r}" for r in range(nproc))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TIKTOKEN_CACHE_DIR=str(TIKTOKEN_DIR),
                   WANDB_MODE="disabled", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([str(repo / "testing" / "boot"), str(repo)]), MINGPT_FAULT=faults)
        has_train_point = '"train"' in (repo / "observe" / "hooks.py").read_text() \
            if (repo / "observe" / "hooks.py").is_file() else False
        argv = torchrun_argv(nproc, ["main.py", *COMMON, *overrides, f"trainer.run_dir={run_dir}/run"])
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
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if len(found) < 2:
            raise RuntimeError(f"the launch ended before both readings ({sorted(found)}):\n{''.join(output[-20:])}")
        return found


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M).group(1)
    flags = set(re.search(r"^flags\s*:\s*(.*)$", text, re.M).group(1).split())
    return f"{model}; {', '.join(sorted(f for f in flags if f.startswith(('avx512', 'amx', 'avx2'))))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent,
                    help="the checkout whose main.py runs (default: this one)")
    ap.add_argument("--case", nargs="+", action="append", metavar=("NAME NPROC", "OVERRIDES"),
                    help="NAME NPROC OVERRIDE... (repeatable; default: the shipped cases)")
    args = ap.parse_args()
    cases = [(c[0], int(c[1]), c[2:]) for c in args.case] if args.case else CASES
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit} | {cpu_flags()} | model 16 x 1024 = {MODEL_BYTES / 1e6:.0f} MB fp32")
    print(f"{'case':<12} {'ranks':>5}  {'built (x model)':>16}  {'first step (x model)':>21}  worker peaks above the tiny launch, MB")
    for name, nproc, overrides in cases:
        with multiprocess_lock():
            big = measure(args.repo, nproc, MODEL + overrides)
            tiny = measure(args.repo, nproc, TINY_MODEL + overrides)
        above = {k: max(big[k][r] - tiny[k][r] for r in big[k]) for k in big}  # the worst rank, against its own rank
        print(f"{name:<12} {nproc:>5}  {above['built'] / MODEL_BYTES:>16.2f}  {above['step'] / MODEL_BYTES:>21.2f}  "
              f"built {above['built'] / 1e6:.0f}, first step {above['step'] / 1e6:.0f}", flush=True)


if __name__ == "__main__":
    main()
