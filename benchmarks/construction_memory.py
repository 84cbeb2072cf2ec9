"""Each worker's peak host memory when the model is built, and through the first step, per layout.

    python benchmarks/construction_memory.py                       # the default cases (minutes)
    python benchmarks/construction_memory.py --case fsdp 8 parallel.strategy=fsdp
    python benchmarks/construction_memory.py --repo ../old-checkout # the same cases on another commit
    python benchmarks/construction_memory.py --malloc both --speed  # glibc's default beside the fixed threshold
    python benchmarks/construction_memory.py --sweep               # 1, 2, 4 and 8 processes (an hour)

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

main.py fixes glibc's mmap threshold at 1 MiB (observe/host_memory.py); `--malloc default` runs the
workers with glibc's own behaviour instead (MINGPT_GLIBC_MALLOC=default), `both` prints the two, and
`--speed` times both settings (tokens/s of a 6-step fsdp x2 run of the same model, alternated twice).
The stop-and-read mechanism is testing/memory_probe.py (tests/test_construction_memory.py uses it too).

It runs the commit it is in (or --repo's): the figures before and after a change come from two runs.
CPU flags are printed beside the figures (they do not change memory, but the guide asks for them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from _repo import REPO

from observe.perf import cpu_model
from parallel.precision import cpu_flags as all_cpu_flags
from testing.local import CORPUS, child_env, multiprocess_lock, torchrun_argv
from testing.memory_probe import measure

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


def sweep_cases() -> list[tuple[str, int, list[str]]]:
    """`--sweep`: ddp, fsdp, zero-3, tp=2, pp=2 and HSDP at 1, 2, 4 and 8 processes; tp and pp
    take the processes they leave to fsdp, HSDP replicates twice and shards over the rest. Not
    ddp x8: 8 replicas at 4x of the 16 x 1024 model through a step (26 GB) pass this machine's
    24 GB."""
    cases = []
    for n in (1, 2, 4, 8):
        cases += [(f"ddp x{n}", n, ["parallel.strategy=ddp"])] if n < 8 else []
        cases += [(f"fsdp x{n}", n, ["parallel.strategy=fsdp"]),
                  (f"zero-3 x{n}", n, ["parallel.strategy=zero", "parallel.zero_stage=3"])]
        if n >= 2:
            rest = "fsdp" if n > 2 else "none"
            cases += [(f"tp=2 x{n}", n, [f"parallel.strategy={rest}", "parallel.tp=2"]),
                      (f"pp=2 x{n}", n, [f"parallel.strategy={rest}", "parallel.pp=2"]),
                      (f"hsdp 2x{n // 2}", n, ["parallel.strategy=fsdp", "parallel.dp_replicate=2"])]
    return cases


def cpu_flags() -> str:
    """The CPU's model and its vector flags, for the line printed beside the figures."""
    return f"{cpu_model()}; {', '.join(sorted(f for f in all_cpu_flags() if f.startswith(('avx512', 'amx', 'avx2'))))}"


def speed(repo: Path, nproc: int, overrides: list[str], env: dict[str, str], steps: int = 6) -> float:
    """Median tokens/s of steps 2.. of a short run of the 16 x 1024 model (metrics.jsonl)."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = [*COMMON, *MODEL, *overrides, f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}/run"]
        r = subprocess.run(torchrun_argv(nproc, ["main.py", *args]), cwd=repo, capture_output=True, text=True,
                           env=child_env(**env), timeout=1800)
        if r.returncode:
            raise RuntimeError(r.stdout[-2000:] + r.stderr[-2000:])
        rows = [json.loads(line) for line in (Path(run_dir) / "run" / "metrics.jsonl").read_text().splitlines()]
        return statistics.median(row["tokens_per_sec"] for row in rows if row.get("step", 0) >= 2
                                 and "tokens_per_sec" in row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose main.py runs (default: this one)")
    ap.add_argument("--case", nargs="+", action="append", metavar=("NAME NPROC", "OVERRIDES"),
                    help="NAME NPROC OVERRIDE... (repeatable; default: the shipped cases)")
    ap.add_argument("--sweep", action="store_true", help="the layouts at 1, 2, 4 and 8 processes (sweep_cases)")
    ap.add_argument("--malloc", choices=("fixed", "default", "both"), default="fixed",
                    help="glibc's mmap threshold: fixed at 1 MiB (what main.py sets, observe/host_memory.py), "
                         "glibc's default (MINGPT_GLIBC_MALLOC=default), or both side by side")
    ap.add_argument("--speed", action="store_true", help="also tokens/s of a 6-step fsdp x2 run, both mallocs, "
                    "alternated twice")
    args = ap.parse_args()
    cases = [(c[0], int(c[1]), c[2:]) for c in args.case] if args.case else sweep_cases() if args.sweep else CASES
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit} | {cpu_flags()} | model 16 x 1024 = {MODEL_BYTES / 1e6:.0f} MB fp32")
    mallocs = ["fixed", "default"] if args.malloc == "both" else [args.malloc]
    print(f"{'case':<12} {'malloc':<8} {'ranks':>5}  {'built (x model)':>16}  {'first step (x model)':>21}  "
          f"worker peaks above the tiny launch, MB")
    for name, nproc, overrides in cases:
        for malloc in mallocs:
            env = {"MINGPT_GLIBC_MALLOC": malloc}
            with multiprocess_lock():
                big = measure(args.repo, nproc, COMMON + MODEL + overrides, **env)
                tiny = measure(args.repo, nproc, COMMON + TINY_MODEL + overrides, **env)
            above = {k: max(big[k][r] - tiny[k][r] for r in big[k]) for k in big}  # the worst rank, against its own rank
            print(f"{name:<12} {malloc:<8} {nproc:>5}  {above['built'] / MODEL_BYTES:>16.2f}  "
                  f"{above['step'] / MODEL_BYTES:>21.2f}  built {above['built'] / 1e6:.0f}, first step "
                  f"{above['step'] / 1e6:.0f}", flush=True)
    if args.speed:
        for attempt in (1, 2):
            for malloc in ("fixed", "default"):
                with multiprocess_lock():
                    tps = speed(args.repo, 2, ["parallel.strategy=fsdp"], {"MINGPT_GLIBC_MALLOC": malloc})
                print(f"speed fsdp x2, 16 x 1024, malloc {malloc:<8} (run {attempt}): {tps:,.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
