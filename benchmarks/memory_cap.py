"""A launch whose every worker is capped below the whole model's size, and trains anyway.

    python benchmarks/memory_cap.py                                  # fsdp x8, 24 x 1536, cap 2 GB (minutes)
    python benchmarks/memory_cap.py --repo ../old-checkout           # the same launch on another commit
    python benchmarks/memory_cap.py --cap-gb 1.5 parallel.strategy=zero parallel.zero_stage=3

Each torchrun worker first moves itself into a memory cgroup of its own (cgroup v1, under this
process's memory cgroup: writing one needs root, and no swap may hide the cap) whose limit,
`memory.limit_in_bytes`, is below the model's fp32 bytes (24 x 1536 by default: 680M parameters,
2.72 GB), then runs main.py: 3 optimizer steps and the end-of-run model.pt. A rank that allocated
the whole model would be killed by the kernel's OOM killer the moment it passed the cap; a rank
that holds only its share never gets near it. Printed per worker: its cgroup's peak usage
(`memory.max_usage_in_bytes`: resident memory and the page cache it charged, which the kernel
reclaims before it kills), the number of times it hit the cap (`memory.failcnt`), OOM kills, and
the launch's exit code. docs/layouts.md holds the figures of the last run.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _repo import REPO
from construction_memory import cpu_flags

from testing.local import CORPUS, child_env, multiprocess_lock, torchrun_argv

MODEL = ["model.n_layer=24", "model.n_head=16", "model.n_embd=1536"]
MODEL_BYTES = 4 * (24 * (12 * 1536 * 1536 + 13 * 1536) + (65 + 64) * 1536 + 2 * 1536)  # fp32, char vocab 65
COMMON = [f"data.path={CORPUS}", "data.truncate=200000", "model.block_size=64", "trainer.batch_size=8",
          "trainer.micro_batch_size=1", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0",
          "trainer.save_every=0", "trainer.sample_tokens=0", "wandb.enabled=false", "trainer.hang_timeout_s=0",
          "optimizer.warmup_steps=1"]
# a worker's first act: join its own capped group (LOCAL_RANK is torchrun's), then become main.py.
# Writing 0 to cgroup.procs moves the writer itself; `$$` would not do: torchrun substitutes its
# arguments as string.Template macros, which turns `$$` into `$`
ENTER = 'echo 0 > "$MINGPT_CAP_GROUP/rank$LOCAL_RANK/cgroup.procs" && exec "$0" "$@"'


def own_memory_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    raise SystemExit("no cgroup v1 memory controller here: this demonstration needs one (and root)")


def read(group: Path, name: str) -> str:
    return (group / name).read_text().strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose main.py runs (default: this one)")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--cap-gb", type=float, default=2.0, help="each worker's memory limit, GB (1e9 bytes)")
    ap.add_argument("overrides", nargs="*", default=["parallel.strategy=fsdp"], help="config overrides (the layout)")
    args = ap.parse_args()
    if not re.search(r"^SwapTotal:\s+0 kB$", Path("/proc/meminfo").read_text(), re.M):
        print("note: this machine has swap; a worker over its cap may swap rather than be killed")
    cap = int(args.cap_gb * 1e9)
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit} | {cpu_flags()}")
    print(f"model 24 x 1536 = {MODEL_BYTES / 1e9:.2f} GB fp32; {args.nproc} workers, each capped at "
          f"{cap / 1e9:.2f} GB ({cap / MODEL_BYTES:.2f}x the model); {' '.join(args.overrides)}")
    parent = own_memory_cgroup() / f"mingpt-cap-{os.getpid()}"
    groups = [parent / f"rank{r}" for r in range(args.nproc)]
    parent.mkdir()
    try:
        for g in groups:
            g.mkdir()
            (g / "memory.limit_in_bytes").write_text(str(cap))
        with tempfile.TemporaryDirectory() as run_dir, multiprocess_lock():
            argv = torchrun_argv(args.nproc, ["--no-python", "sh", "-c", ENTER, sys.executable, "main.py", *COMMON, *MODEL,
                                              *args.overrides, f"trainer.run_dir={run_dir}/run"])
            start = time.monotonic()
            r = subprocess.run(argv, cwd=args.repo, capture_output=True, text=True, timeout=3600,
                               env=child_env(MINGPT_CAP_GROUP=str(parent), MINGPT_PG_TIMEOUT="900"))
            seconds = time.monotonic() - start
            wrote = (Path(run_dir) / "run" / "model.pt").is_file()
        for rank, g in enumerate(groups):
            oom = dict(line.split() for line in read(g, "memory.oom_control").splitlines()).get("oom_kill", "?")
            print(f"worker {rank}: peak {int(read(g, 'memory.max_usage_in_bytes')) / 1e9:.2f} GB "
                  f"({int(read(g, 'memory.max_usage_in_bytes')) / MODEL_BYTES:.2f}x the model), "
                  f"hit the cap {read(g, 'memory.failcnt')} times, OOM kills {oom}")
        done = next((line for line in (r.stdout + r.stderr).splitlines() if line.startswith("done:")), "no 'done:' line")
        print(f"exit {r.returncode} after {seconds:.0f} s; {done}; model.pt written: {wrote}")
        if r.returncode:
            errors = [line for line in (r.stdout + r.stderr).splitlines() if "rror" in line or "Killed" in line]
            print("last output:\n" + "\n".join((errors or (r.stdout + r.stderr).splitlines())[-15:]))
    finally:
        for g in [*groups, parent]:
            with contextlib.suppress(OSError):
                g.rmdir()


if __name__ == "__main__":
    main()
