"""What one GPU proves in about five minutes: `bash scripts/gpu_check.sh` (this file does the work).

Every check launches the app as a user would (`python main.py ...` or a one-process torchrun) on a
small model and reads what it printed and wrote (the cp checks: testing/cp_probe.py on 2 and 4
processes sharing the GPU); each prints one line, `PASS <check>: <figures>`
or `FAIL <check>: <why>` (SKIP for the checks that need more GPUs than this machine has). The
checks run side by side (one GPU holds them all), the compiled preset last and alone, since its
tokens/s and MFU are figures. Exit 0 when nothing failed, 1 when a check failed, 2 with one line
when there is no CUDA device (it never passes by doing nothing).

It needs torch 2.11 or later with CUDA, and nothing that the GPU machine may lack: no wandb
(every run sets wandb.enabled=false), no network (the corpus is the Tiny Shakespeare file beside
the repository when there is one, else the offline fallback text written into the work folder).
`--out DIR` keeps every run's folder and output there.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIN_TORCH = (2, 11)
OFFLOAD = ("parallel.strategy=fsdp", "parallel.cpu_offload=true")
SMALL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=64", "trainer.batch_size=16",
         "trainer.eval_batches=2", "trainer.sample_tokens=0", "wandb.enabled=false", "trainer.device=cuda",
         "optimizer.warmup_steps=5"]


@dataclass
class Result:
    name: str
    verdict: str  # PASS | FAIL | SKIP
    detail: str

    def line(self) -> str:
        return f"{self.verdict} {self.name}: {self.detail}"


class Check:
    """The work folder, the corpus and the launches every check shares."""

    def __init__(self, work: Path, corpus: Path):
        self.work, self.corpus = work, corpus

    def env(self, **extra) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled",
                   PYTHONPATH=os.pathsep.join([str(REPO / "testing" / "boot"), str(REPO), os.environ.get("PYTHONPATH", "")]))
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, name: str, argv: list[str], timeout: float = 180, **env) -> subprocess.CompletedProcess:
        """argv in the repository, output kept in <work>/<name>.log."""
        try:
            r = subprocess.run(argv, cwd=REPO, env=self.env(**env), capture_output=True, text=True, timeout=timeout,
                               start_new_session=True)
        except subprocess.TimeoutExpired as e:
            out, err = (x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
            r = subprocess.CompletedProcess(argv, 124, out, err + f"\n[gpu_check] timed out after {timeout:g} s")
        (self.work / f"{name}.log").write_text(f"$ {' '.join(argv)}\n--- exit {r.returncode}\n--- stdout\n{r.stdout}"
                                               f"\n--- stderr\n{r.stderr}", encoding="utf-8")
        return r

    def main(self, name: str, *overrides: str, timeout: float = 180, **env) -> subprocess.CompletedProcess:
        return self.run(name, [sys.executable, "main.py", f"data.path={self.corpus}", *SMALL, *overrides],
                        timeout, **env)

    def launch(self, name: str, nproc: int, args: list[str], timeout: float = 180, **env) -> subprocess.CompletedProcess:
        """`args` under a standalone torchrun of `nproc` ranks (the suite's command line)."""
        from testing.local import torchrun_argv  # the repository is on sys.path by now
        return self.run(name, torchrun_argv(nproc, args), timeout, **env)

    def torchrun(self, name: str, *overrides: str, timeout: float = 180, **env) -> subprocess.CompletedProcess:
        return self.launch(name, 1, ["main.py", f"data.path={self.corpus}", *SMALL, *overrides], timeout, **env)


def tail(r: subprocess.CompletedProcess, n: int = 1) -> str:
    """The last non-empty lines of a run's output, for a FAIL line."""
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-400:] if lines else "(no output)"


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def model_tensors(run: Path) -> dict:
    import torch
    return torch.load(run / "model.pt", map_location="cpu", weights_only=True)["model"]


# ----------------------------------------------------------------------------- the checks


def check_cuda() -> Result:
    import torch
    import torch.distributed as dist
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # warm-up: cuBLAS's start and its choice of kernel
        x @ x
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        x @ x
    torch.cuda.synchronize()
    tflops = 20 * 2 * 4096 ** 3 / (time.perf_counter() - t0) / 1e12
    props = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
    return Result("cuda", "PASS", f"{torch.cuda.get_device_name(0)} (sm_{props.major}{props.minor}, "
                  f"{props.total_memory / 2**30:.0f} GiB) x {torch.cuda.device_count()} | torch {torch.__version__} "
                  f"| CUDA {torch.version.cuda} | NCCL {nccl} | bf16 4096^3 matmul {tflops:.0f} TFLOP/s")


def check_flight_recorder(c: Check) -> Result:
    """The watchdog's reader (guards/watchdog.flight_records) sees NCCL's CUDA collectives."""
    r = c.launch("flight_recorder", 1, ["scripts/gpu_check.py", "--probe-flight-recorder"], 120, TORCH_FR_BUFFER_SIZE=200)
    found = re.search(r"^probe: (\{.*\})$", r.stdout, re.M)
    if r.returncode != 0 or not found:
        return Result("nccl-flight-recorder", "FAIL", f"exit {r.returncode}: {tail(r)}")
    probe = json.loads(found.group(1))
    nccl = [n for n in probe["names"] if n.startswith("nccl:")]
    verdict = "PASS" if nccl else "FAIL"
    return Result("nccl-flight-recorder", verdict, f"{len(probe['names'])} entries, NCCL's: {sorted(set(nccl)) or 'none'}")


def probe_flight_recorder() -> None:
    """Inside a one-rank torchrun: the app's process group, one NCCL all-reduce, what the watchdog reads."""
    import torch
    import torch.distributed as dist

    from checks import load_config
    from guards.watchdog import flight_records
    from parallel.env import init_distributed
    env = init_distributed(load_config(None, ["trainer.device=cuda", "trainer.hang_timeout_s=30"]))
    t = torch.ones(1024, device=env.device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    names = [e.get("profiling_name", "") for e in flight_records()]
    print("probe: " + json.dumps({"names": names, "sum": float(t.sum())}), flush=True)
    dist.destroy_process_group()


def check_cp(c: Check, ranks: int) -> Result:
    """parallel.cp's attention on this GPU's block kernels: `ranks` processes of testing/cp_probe.py."""
    r = c.launch(f"cp{ranks}", ranks, ["-m", "testing.cp_probe"], 150)
    found = re.search(r"^cp-probe: (\{.*\})$", r.stdout, re.M)
    probe = json.loads(found.group(1)) if found and r.returncode == 0 else {}
    ok = probe.get("within_bounds") and probe.get("device", "cpu") != "cpu"
    return Result(f"cp{ranks}-attention", "PASS" if ok else "FAIL", probe.get("summary") or f"exit {r.returncode}: {tail(r, 2)}")


def check_snapshots(c: Check, name: str, *overrides: str, background: bool) -> Result:
    """A one-rank torchrun on the GPU that saves snapshots synchronously or in the background; the
    start-up line, the peak label and the CUDA memory columns of a GPU run. The hang watchdog at 10 s
    turns a stuck save into a line and a stack dump (run_dir/hang) where the GIL is free."""
    run = c.work / name
    args = [f"data.path={c.corpus}", *SMALL, f"trainer.run_dir={run}", *overrides, "trainer.max_steps=30",
            "trainer.save_every=10", "trainer.log_every=5", "trainer.eval_every=30", "trainer.hang_timeout_s=10",
            f"trainer.async_save={str(background).lower()}"]
    r = c.launch(name, 1, ["main.py", *args], 150)
    snaps = sorted(p.name for p in (run / "snapshots").glob("step_*")) if (run / "snapshots").is_dir() else []
    if r.returncode != 0:
        hang = next((l for l in r.stdout.splitlines() if l.startswith("hang:")), None)
        return Result(name, "FAIL", f"exit {r.returncode}: {hang or tail(r, 2)}")
    problems = []
    if "| device cuda:0" not in r.stdout:
        problems.append("start-up line lacks '| device cuda:0'")
    label = re.search(r"mfu peak (.*)$", r.stdout, re.M)
    if not label or "TFLOP/s" not in label.group(1):
        problems.append(f"peak label {label.group(1) if label else None!r}")
    logged = rows(run)
    peaks = [row.get("cuda_peak_allocated_mb", 0) for row in logged if "loss" in row]
    if not peaks or min(peaks) <= 0:
        problems.append(f"cuda_peak_allocated_mb {peaks}")
    saves = [(row["save_blocking_ms"], row["save_total_ms"]) for row in logged if "save_total_ms" in row]
    if background and (not saves or not all(b < t for b, t in saves)):
        problems.append(f"save_blocking_ms < save_total_ms fails: {saves}")
    if snaps != ["step_0000020", "step_0000030"]:
        problems.append(f"snapshots {snaps}")
    detail = (f"snapshots {snaps}, cuda peak per window {min(peaks or [0]):.1f}-{max(peaks or [0]):.1f} MB, "
              f"saves blocking/total ms {[(round(b), round(t)) for b, t in saves]}, peak: {label.group(1) if label else '?'}")
    return Result(name, "FAIL" if problems else "PASS", ("; ".join(problems) + " | " if problems else "") + detail)


def _resume_pair(c: Check, name: str, deterministic: bool) -> tuple[subprocess.CompletedProcess, ...]:
    common = ["model.dropout=0.1", "trainer.max_steps=40", "trainer.save_every=10", "trainer.log_every=5",
              "trainer.eval_every=40", "optimizer.lr_decay_steps=40", f"trainer.deterministic={str(deterministic).lower()}"]
    whole = c.main(f"{name}-whole", f"trainer.run_dir={c.work / (name + '-whole')}", *common)
    stopped = c.main(f"{name}-stopped", f"trainer.run_dir={c.work / (name + '-resumed')}", *common,
                     MINGPT_FAULT="term:update:25:0")
    resumed = c.main(f"{name}-resumed", f"trainer.run_dir={c.work / (name + '-resumed')}", *common)
    return whole, stopped, resumed


def _max_difference(a: Path, b: Path) -> tuple[float, int]:
    ta, tb = model_tensors(a), model_tensors(b)
    gaps = [float((ta[k].float() - tb[k].float()).abs().max()) for k in ta]
    return max(gaps), sum(gap != 0 for gap in gaps)


def check_resume(c: Check) -> Result:
    """Uninterrupted against SIGTERM at step 25 + resume (dropout on): bit for bit under
    trainer.deterministic; how far apart without it."""
    figures, problems = [], []
    for deterministic in (True, False):
        name = "resume-" + ("deterministic" if deterministic else "default")
        whole, stopped, resumed = _resume_pair(c, name, deterministic)
        if whole.returncode != 0 or stopped.returncode != 128 + signal.SIGTERM or resumed.returncode != 0:
            problems.append(f"{name}: exits {whole.returncode}/{stopped.returncode}/{resumed.returncode} "
                            f"(want 0/{128 + signal.SIGTERM}/0): {tail(whole if whole.returncode else stopped if stopped.returncode != 143 else resumed)}")
            continue
        if "resumed from" not in resumed.stdout:
            problems.append(f"{name}: the relaunch did not resume")
        worst, differing = _max_difference(c.work / (name + "-whole"), c.work / (name + "-resumed"))
        figures.append(f"{name}: {differing} tensors differ, max |diff| {worst:.3g}")
        if deterministic and differing:
            problems.append(f"{name} is not bit-identical")
    return Result("resume-bit-exact", "FAIL" if problems else "PASS", "; ".join(problems + figures))


def check_fp16(c: Check) -> Result:
    run = c.work / "fp16"
    r = c.main("fp16", f"trainer.run_dir={run}", "trainer.precision=fp16", "trainer.max_steps=60",
               "trainer.log_every=10", "trainer.eval_every=60", "optimizer.lr=3e-3")
    if r.returncode != 0:
        return Result("fp16-grad-scaler", "FAIL", f"exit {r.returncode}: {tail(r, 2)}")
    losses = [row["loss"] for row in rows(run) if "loss" in row]
    metas = sorted((run / "snapshots").glob("step_*/meta.json"))
    scaler = json.loads(metas[-1].read_text()).get("scaler") if metas else None
    scale = (scaler or {}).get("scale")
    ok = losses and all(l == l and abs(l) < 1e4 for l in losses) and losses[-1] < losses[0] and scale and scale > 0
    return Result("fp16-grad-scaler", "PASS" if ok else "FAIL",
                  f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} rows, scale in the snapshot {scale}"
                  if losses else "no metrics rows")


def check_matmul_attention(c: Check) -> Result:
    """trainer.attention=matmul (plain-op attention, model.py) with the model compiled as one graph
    (trainer.compile_scope=model), as presets/cpu_fast.yaml runs, beside the fused kernel eager, bf16,
    40 steps: the same training within bf16's rounding (every logged loss within 2%)."""
    losses = {}
    whole = ("parallel.strategy=none", "trainer.compile=true", "trainer.compile_scope=model")
    for kernel in ("sdpa", "matmul"):
        run = c.work / f"attention-{kernel}"
        r = c.main(f"attention-{kernel}", f"trainer.run_dir={run}", "trainer.precision=bf16", "trainer.max_steps=40",
                   "trainer.log_every=10", "trainer.eval_every=40", f"trainer.attention={kernel}",
                   *(whole if kernel == "matmul" else ()))
        if r.returncode != 0:
            return Result("matmul-attention", "FAIL", f"{kernel}: exit {r.returncode}: {tail(r, 2)}")
        losses[kernel] = [row["loss"] for row in rows(run) if "loss" in row]
    a, b = losses["sdpa"], losses["matmul"]
    ok = len(a) == len(b) > 1 and all(abs(x - y) <= 0.02 * abs(x) for x, y in zip(a, b)) and b[-1] < b[0]
    return Result("matmul-attention", "PASS" if ok else "FAIL", f"losses sdpa {a} vs matmul {b}")


def check_hang(c: Check) -> Result:
    """A training thread blocked forever on one rank (MINGPT_FAULT=block): the watchdog's line, exit 4,
    and NCCL's own recorder in the dump folder."""
    run = c.work / "hang"
    r = c.torchrun("hang", f"trainer.run_dir={run}", "trainer.max_steps=40", "trainer.log_every=2",
                   "trainer.eval_every=40", "trainer.hang_timeout_s=3", timeout=150, MINGPT_FAULT="block:update:8:0")
    line = next((l for l in r.stdout.splitlines() if l.startswith("hang:")), None)
    dumps = run / "hang" / "attempt0"
    files = sorted(p.name for p in dumps.iterdir()) if dumps.is_dir() else []
    nccl = dumps / "nccl_trace_rank_0"
    names = []
    if nccl.is_file():
        try:
            names = sorted({e.get("profiling_name", "") for e in pickle.loads(nccl.read_bytes()).get("entries", [])})
        except Exception as e:  # a dump the analyser could not read is a failure of this check
            names = [f"unreadable: {type(e).__name__}"]
    ok = line is not None and r.returncode != 0 and any(n.startswith("nccl:") for n in names)
    return Result("hang-watchdog-nccl", "PASS" if ok else "FAIL",
                  f"exit {r.returncode}, line: {line[:160] if line else tail(r)}; dumps {files}; NCCL trace names {names[:4]}")


def check_preset_compile(c: Check) -> Result:
    """presets/gpu_8x8x512.yaml as shipped (bf16, compile, batch 256) for 150 steps on one GPU."""
    run = c.work / "preset"
    r = c.run("preset", [sys.executable, "main.py", "--config", "presets/gpu_8x8x512.yaml", f"data.path={c.corpus}",
                         f"trainer.run_dir={run}", "trainer.max_steps=150", "trainer.eval_every=150",
                         "trainer.save_every=0", "trainer.log_every=25", "trainer.sample_tokens=0",
                         "trainer.eval_batches=4", "wandb.enabled=false"], 300, TORCH_LOGS="recompiles")
    if r.returncode != 0:
        return Result("gpu-preset-bf16-compile", "FAIL", f"exit {r.returncode}: {tail(r, 2)}")
    logged = [row for row in rows(run) if "mfu" in row]
    recompiles = len(re.findall(r"Recompiling function", r.stderr))
    last = logged[-1] if logged else {}
    mfu, tps = last.get("mfu", 0), last.get("tokens_per_sec", 0)
    ok = 0 < mfu < 1 and recompiles <= 4
    return Result("gpu-preset-bf16-compile", "PASS" if ok else "FAIL",
                  f"last window {tps:,.0f} tokens/s, MFU {mfu:.3f}, step {last.get('step_time_ms', 0):.1f} ms, "
                  f"{recompiles} recompiles, cuda peak {last.get('cuda_peak_allocated_mb', 0):.0f} MB")


# the suite's selections run on CUDA with 2+ GPUs (tests/test_gpu_paths.py: each collects tests)
MULTI_GPU_TESTS = {"ddp-fsdp-tp-pp-parity": ["tests/test_data_parallel.py", "tests/test_tp_pp.py", "-k", "parity or matches"],
                   "nn-dataparallel": ["tests/test_data_parallel.py", "-k", "nn_dataparallel"],
                   "frozen-peer": ["tests/test_hang.py"]}


def check_multi_gpu(c: Check, gpus: int) -> list[Result]:
    """With 2+ GPUs: the suite's parity, nn.DataParallel and frozen-peer tests on CUDA."""
    if gpus < 2:
        return [Result(n, "SKIP", f"needs 2+ GPUs (one GPU holds one NCCL rank); this machine has {gpus}")
                for n in MULTI_GPU_TESTS]
    runs = {name: c.run(name, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], 600,
                        MINGPT_TEST_DEVICE="cuda") for name, args in MULTI_GPU_TESTS.items()}
    return [Result(name, "PASS" if r.returncode == 0 else "FAIL", tail(r)) for name, r in runs.items()]


def corpus_file(work: Path) -> Path:
    shakespeare = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
    if shakespeare.is_file():
        return shakespeare
    from corpus.text import fallback_corpus
    path = work / "corpus.txt"
    path.write_text(fallback_corpus()[:1_000_000], encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="keep every run's folder and output here (default: a temporary folder)")
    ap.add_argument("--probe-flight-recorder", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe_flight_recorder:
        probe_flight_recorder()
        return 0
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device; run it on a machine with an NVIDIA GPU",
              flush=True)
        return 2
    version = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2])
    if version < MIN_TORCH:
        print(f"gpu_check: torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}; install a newer "
              f"CUDA build of torch", flush=True)
        return 2
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    if args.out and work.exists() and any(work.iterdir()):
        print(f"gpu_check: --out {work} is not empty; name a new folder", flush=True)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    c = Check(work, corpus_file(work))
    start = time.perf_counter()
    results = [check_cuda()]
    print(results[0].line(), flush=True)
    side_by_side = [("nccl-flight-recorder", lambda: check_flight_recorder(c)),
                    ("fsdp-offload-sync-save", lambda: check_snapshots(c, "fsdp-offload-sync-save", *OFFLOAD,
                                                                       background=False)),
                    ("fsdp-offload-async-save", lambda: check_snapshots(c, "fsdp-offload-async-save", *OFFLOAD,
                                                                        background=True)),
                    ("async-save", lambda: check_snapshots(c, "async-save", background=True)),
                    ("resume-bit-exact", lambda: check_resume(c)), ("fp16-grad-scaler", lambda: check_fp16(c)),
                    ("hang-watchdog-nccl", lambda: check_hang(c)),
                    ("matmul-attention", lambda: check_matmul_attention(c)),
                    ("cp2-attention", lambda: check_cp(c, 2)), ("cp4-attention", lambda: check_cp(c, 4))]
    with ThreadPoolExecutor(max_workers=len(side_by_side)) as pool:
        for result in pool.map(lambda named: _guarded(*named), side_by_side):
            print(result.line(), flush=True)
            results.append(result)
    results.append(_guarded("gpu-preset-bf16-compile", lambda: check_preset_compile(c)))  # alone: its figures
    print(results[-1].line(), flush=True)
    for result in check_multi_gpu(c, torch.cuda.device_count()):
        print(result.line(), flush=True)
        results.append(result)
    failed = [r.name for r in results if r.verdict == "FAIL"]
    print(f"gpu_check: {sum(r.verdict == 'PASS' for r in results)} passed, {len(failed)} failed, "
          f"{sum(r.verdict == 'SKIP' for r in results)} skipped in {time.perf_counter() - start:.0f} s"
          f"{' (' + ', '.join(failed) + ')' if failed else ''}; runs in {work}", flush=True)
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def _guarded(name: str, check) -> Result:
    """A check that raised is a FAIL line, not the end of the others."""
    try:
        return check()
    except Exception as e:
        return Result(name, "FAIL", f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    sys.exit(main())
