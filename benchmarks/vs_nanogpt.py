"""Side by side with nanoGPT: its own train.py and this project's main.py on nanoGPT's CPU config,
one after the other on this machine, each model's val loss measured the same way.

nanoGPT's README runs, on a CPU (eager):
    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
This script runs exactly that on a scratch copy of ../shared/peers/nanoGPT (its data prepared from
the same Tiny Shakespeare file; its hard-coded seed 1337 made a `--seed` key, default 1337), then main.py with the same model, batch, steps and schedule
(benchmarks/cpu_shakespeare.py's NANOGPT_CPU, plus any overrides given, e.g. a preset's speed
settings), both with the same threads. Printed per run: the median time of a training step
(nanoGPT's per-iteration `time`, this project's step_time_ms; neither includes evaluation),
tokens/s at that median, the wall time, and the val loss of the final weights on the WHOLE
validation split, in non-overlapping 64-token windows of nanoGPT's split (the last 10% of the text),
each model with its own tokenizer: nanoGPT's 20 random eval batches are too noisy to compare.
Then the ratio of tokens/s and the difference of val loss, and the ratio again at each side's
10th-percentile 10-step window (nanoGPT's iterations averaged in tens as this project logs them):
on a shared 2-core machine either run is slowed in bursts (a whole step 25 -> 33 ms for a minute
while nothing of ours changed), which moves the medians of runs made one after the other. The CPU's model and
the flags that decide its fastest precision are printed first and with the results; `--also-fp32`
runs ours a second time per seed with trainer.precision=fp32 (a preset's `auto` beside its fallback).
`--turns S` runs a seed's trainings together, one at a time for S seconds each: the steps a process
was stopped in are left out of its figures, and the ratio is also given cycle by cycle (one turn of
every side), the sides measured seconds apart under the same load. `--seeds 1337 42` repeats both runs
per seed and reports the spread.

    python benchmarks/vs_nanogpt.py                       # 2000 steps, 2 threads
    python benchmarks/vs_nanogpt.py --steps 500           # shorter (the loss is then not nanoGPT's)
    python benchmarks/vs_nanogpt.py --preset presets/cpu_speedrun.yaml --seeds 1337 42 7   # time to nanoGPT's loss
    python benchmarks/vs_nanogpt.py --preset presets/cpu_fast.yaml --also-fp32 --seeds 1337 42 7   # + its fp32
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import _repo  # noqa: F401  (the repository on sys.path)
import torch
import yaml
from cpu_shakespeare import NANOGPT_CPU

from model import GPT, GPTConfig
from observe.perf import cpu_line
from testing.local import CORPUS, REPO, SHARED
from weights.model_file import read_model_file

NANOGPT = SHARED / "peers" / "nanoGPT"
BLOCK, BATCH = 64, 12
ITERATION = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.M)  # nanoGPT's line per iteration
MIN_TURN_S = 1.0  # the shortest --turns: a few 10-step windows of the slowest side per turn
WINDOW = 10  # steps per timing window on both sides: this project logs a 10-step mean (log_every=10)


def nanogpt_args(steps: int, seed: int, out: Path) -> list[str]:
    return ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
            "--log_interval=1", f"--block_size={BLOCK}", f"--batch_size={BATCH}", "--n_layer=4", "--n_head=4",
            "--n_embd=128", f"--max_iters={steps}", f"--lr_decay_iters={steps}", "--dropout=0.0",
            f"--out_dir={out}", "--always_save_checkpoint=True", f"--eval_interval={eval_interval(steps)}",
            f"--seed={seed}"]


def eval_interval(steps: int) -> int:
    return min(250, steps)


def env(threads: int) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    e.pop("TORCH_FR_BUFFER_SIZE", None)
    return e


@dataclass
class Finished:
    """One training process, run to its end: its output, exit code and wall time."""
    stdout: str
    stderr: str
    returncode: int
    wall_s: float
    # with turns: (cycle, indices of the rows finished in that turn) for each turn it had; a row is
    # a step or window its `rows` counter counts (`kept` leaves out those that span a stop)
    turns: list[tuple[int, range]] = field(default_factory=list)


def run_processes(commands: list[tuple[list[str], Path]], threads: int, turns: float,
                  rows: list[Callable[[Path], int]] | None = None) -> list[Finished]:
    """Run each (argv, cwd) to its end. turns = 0: one after the other. turns > 0: all started, and
    they take turns on the machine, `turns` seconds each (SIGSTOP / SIGCONT: one runs at a time, as
    before), so while they overlap a burst of outside load slows every side alike (the last to
    finish runs its tail alone); each wall time then includes the others' turns. `rows[i]` (given
    the path of command i's stdout file) counts the steps or windows command i has finished so far:
    read after each of its turns, it says which turn each one ran in (Finished.turns), so that a step
    a process was stopped in (it counts the others' turns) is left out, and the sides are compared
    cycle by cycle under the same load."""
    if turns <= 0:
        done = []
        for argv, cwd in commands:
            start = time.perf_counter()
            r = subprocess.run(argv, cwd=cwd, env=env(threads), capture_output=True, text=True)
            done.append(Finished(r.stdout, r.stderr, r.returncode, time.perf_counter() - start))
        return done
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as files:
        logs = [(files.enter_context(open(Path(d) / f"{i}.out", "w+")),
                 files.enter_context(open(Path(d) / f"{i}.err", "w+"))) for i in range(len(commands))]
        start, ends, procs = time.perf_counter(), {}, []
        try:
            for (argv, cwd), (out, err) in zip(commands, logs):
                # its own process group: a turn stops and resumes its children too (inductor's compile workers)
                procs.append(subprocess.Popen(argv, cwd=cwd, env=env(threads), stdout=out, stderr=err, text=True,
                                              start_new_session=True))
                os.killpg(procs[-1].pid, signal.SIGSTOP)
            made, cycle = [0] * len(procs), 0  # rows counted after each process's last turn
            taken: list[list[tuple[int, range]]] = [[] for _ in procs]
            while len(ends) < len(procs):
                for i, proc in enumerate(procs):
                    if i in ends:
                        continue
                    os.killpg(proc.pid, signal.SIGCONT)
                    try:
                        proc.wait(timeout=turns)
                        ends[i] = time.perf_counter()
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGSTOP)
                        wait_stopped(proc.pid)  # counted below once it can add no row
                    if rows:
                        now = rows[i](Path(logs[i][0].name))
                        taken[i].append((cycle, range(made[i], now)))
                        made[i] = now
                cycle += 1
        finally:  # interrupted (Ctrl-C, an error): no stopped process may outlive this one
            for i, proc in enumerate(procs):
                if i not in ends and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        done = []
        for i, (proc, (out, err)) in enumerate(zip(procs, logs)):
            out.seek(0), err.seek(0)
            done.append(Finished(out.read(), err.read(), proc.returncode, ends[i] - start,
                                 turns=taken[i] if rows else []))
        return done


def wait_stopped(pid: int, timeout_s: float = 2.0) -> None:
    """Until the process is stopped (state T in /proc/PID/stat; SIGSTOP is delivered asynchronously)
    or gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in "TtZX":
            return
        time.sleep(0.001)


def nanogpt_command(scratch: Path, steps: int, seed: int) -> tuple[list[str], Path]:
    return [sys.executable, "train.py", *nanogpt_args(steps, seed, nanogpt_out(scratch, seed))], scratch


def nanogpt_out(scratch: Path, seed: int) -> Path:
    return scratch / f"out-{seed}"


def kept(r: Finished, values: list[float | None], skip: int, lead: int) -> tuple[list[float], dict[int, list[float]]]:
    """The values (None: not a training step's) of a run's rows from row `skip` on; with turns only
    the rows timed wholly within one turn, and those again by cycle: the first `lead` rows finished in
    each turn are left out, as the one whose clock ran through the stop before the turn (and, for a
    process that reads its clock before it writes the row, the one before that, timed in the
    previous turn but written in this one, which makes the next the one that spans the stop)."""
    if not r.turns:
        return [v for v in values[skip:] if v is not None], {}
    cycles = {}
    for cycle, rows in r.turns:
        got = [values[i] for i in rows[lead:] if skip <= i < len(values) and values[i] is not None]
        if got:
            cycles[cycle] = got
    return [v for c in sorted(cycles) for v in cycles[c]], cycles


def nanogpt_rows(stdout_file: Path) -> int:
    """nanoGPT's iterations so far: its per-iteration lines (log_interval=1)."""
    return len(ITERATION.findall(stdout_file.read_text(encoding="utf-8", errors="replace")))


def nanogpt_result(r: Finished, scratch: Path, seed: int, eval_interval: int) -> dict:
    if r.returncode != 0:
        raise SystemExit(f"nanoGPT failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    # an iteration that evaluates and saves (iter % eval_interval == 0) is timed with them: not a step
    ms = [None if int(it) % eval_interval == 0 else float(m) for it, m in ITERATION.findall(r.stdout)]
    # nanoGPT reads its clock, then prints the line (after loss.item()): lead 2 (see kept)
    ms, cycles = kept(r, ms, skip=5, lead=2)
    if not ms:
        raise SystemExit("nanoGPT: no iteration was timed within a turn; give a longer --turns")
    windows = [statistics.mean(ms[i:i + WINDOW]) for i in range(0, len(ms) - WINDOW + 1, WINDOW)]
    return {"step_ms": statistics.median(ms), "windows_ms": windows, "cycles": cycles, "wall_s": r.wall_s,
            "tokens_per_step": BATCH * BLOCK, "ckpt": nanogpt_out(scratch, seed) / "ckpt.pt"}


def ours_command(folder: Path, steps: int, seed: int, extra: list[str], preset: str = "",
                 tag: str = "ours") -> tuple[list[str], Path]:
    """nanoGPT's config (NANOGPT_CPU, `steps` steps) + extra; with `preset`, the preset's own
    config, steps and schedule instead (time to loss)."""
    recipe = (["--config", preset] if preset else
              [*NANOGPT_CPU, f"trainer.max_steps={steps}", f"optimizer.lr_decay_steps={steps}"])
    overrides = [*recipe, f"data.path={CORPUS}", f"trainer.seed={seed}", "trainer.hang_timeout_s=0",
                 f"trainer.log_every={WINDOW}", f"trainer.run_dir={our_run(folder, tag, seed)}", *extra]
    return [sys.executable, "main.py", *overrides], REPO


def our_run(folder: Path, tag: str, seed: int) -> Path:
    return folder / f"{tag}-{seed}"


def ours_result(r: Finished, run: Path) -> dict:
    if r.returncode != 0:
        raise SystemExit(f"main.py failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # log_every=10: 10-step means; the first holds the compile
    # lead 1: a window's clock counts train steps only, so a stop after it closes spans no kept row
    windows, cycles = kept(r, [row.get("step_time_ms") for row in rows], skip=1, lead=1)
    if not windows:
        raise SystemExit(f"{run.name}: no {WINDOW}-step window was timed within a turn; give a longer --turns")
    notes = [line for line in r.stdout.splitlines() if line.startswith("precision:")]  # trainer.precision=auto's
    return {"step_ms": statistics.median(windows), "windows_ms": windows, "cycles": cycles, "wall_s": r.wall_s,
            "tokens_per_step": tokens_per_step(run), "model": run / "model.pt", "note": notes[0] if notes else ""}


def our_rows(run: Path) -> int:
    """This project's 10-step windows so far: the rows of its metrics.jsonl (each written whole)."""
    path = run / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def tokens_per_step(run: Path) -> int:
    """batch_size x block_size of a run, from the config.yaml it resolved (a preset's own batch)."""
    cfg = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    return cfg["trainer"]["batch_size"] * cfg["model"]["block_size"]


@torch.no_grad()
def windows_loss(logits_of, ids: torch.Tensor) -> float:
    """Mean cross-entropy over every non-overlapping BLOCK-token window of `ids` (the last partial
    one dropped); `logits_of(x, y)`: the model's logits (B, T, V) for inputs x."""
    n = (ids.numel() - 1) // BLOCK
    x = ids[:n * BLOCK].view(n, BLOCK)
    y = ids[1:n * BLOCK + 1].view(n, BLOCK)
    total = 0.0
    for i in range(0, n, 256):
        logits = logits_of(x[i:i + 256], y[i:i + 256])
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y[i:i + 256].reshape(-1),
                                                   reduction="sum").item()
    return total / (n * BLOCK)


def nanogpt_val_loss(scratch: Path, ckpt: Path, val_text: str, chars: list[str]) -> float:
    spec = importlib.util.spec_from_file_location("nanogpt_model", scratch / "model.py")  # not our model.py
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = nano.GPT(nano.GPTConfig(**state["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state["model"].items()})
    model.eval()
    stoi = {c: i for i, c in enumerate(chars)}
    # with targets nanoGPT returns the logits of every position (without, only the last one's)
    return windows_loss(lambda x, y: model(x, y)[0], torch.tensor([stoi[c] for c in val_text]))


def our_val_loss(model_pt: Path, val_text: str) -> float:
    from corpus.tokenizers import tokenizer_from_dict
    f = read_model_file(model_pt)
    model = GPT(GPTConfig(**f.model_config))
    model.load_state_dict(f.model)
    model.eval()
    return windows_loss(lambda x, y: model(x), tokenizer_from_dict(f.tokenizer).encode(val_text))


def scratch_nanogpt(folder: Path) -> Path:
    """A copy of nanoGPT with its Shakespeare-char data prepared from our copy of the text (offline)."""
    scratch = folder / "nanoGPT"
    shutil.copytree(NANOGPT, scratch)
    # nanoGPT seeds with 1337 in its code: in the copy, `seed` becomes a config key (default 1337)
    train = scratch / "train.py"
    code = train.read_text(encoding="utf-8")
    for old, new in (("config_keys = [", "seed = 1337\nconfig_keys = ["),
                     ("torch.manual_seed(1337 + seed_offset)", "torch.manual_seed(seed + seed_offset)")):
        if old not in code:
            raise SystemExit(f"{train}: nanoGPT's code changed ({old!r} not found); update scratch_nanogpt")
        code = code.replace(old, new, 1)
    train.write_text(code, encoding="utf-8")
    data = scratch / "data" / "shakespeare_char"
    shutil.copy(CORPUS, data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    return scratch


def report(results: dict, seeds: list[int], turns: float = 0.0) -> None:
    """Every run's figures, then each of our runs' ratios to nanoGPT's of the same seed."""
    nanos = results["nanoGPT"]
    for name, runs in results.items():
        for seed, r in zip(seeds, runs):
            r["tokens_per_s"] = r["tokens_per_step"] / r["step_ms"] * 1000
            print(f"{name:21} seed {seed}: median step {r['step_ms']:6.1f} ms = {r['tokens_per_s']:8,.0f} "
                  f"tokens/s | wall {r['wall_s']:5.0f} s | val loss (whole split, 64-token windows) {r['val']:.4f}")
    for name, runs in results.items():
        if name == "nanoGPT":
            continue
        ratios = [o["tokens_per_s"] / n["tokens_per_s"] for n, o in zip(nanos, runs)]
        fast = [fast_tokens_per_s(o) / fast_tokens_per_s(n) for n, o in zip(nanos, runs)]
        diffs = [o["val"] - n["val"] for n, o in zip(nanos, runs)]
        walls = [o["wall_s"] / n["wall_s"] for n, o in zip(nanos, runs)]
        notes = sorted({r["note"] for r in runs if r.get("note")})
        print(f"{name}:{' ' + '; '.join(notes) if notes else ''}")
        caveat = "; with --turns each wall includes the others' turns" if turns else ""
        print(f"  wall time ratio (ours / nanoGPT's, start-up included{caveat}): {', '.join(f'{w:.2f}x' for w in walls)}")
        print(f"  tokens/s ratio (ours / nanoGPT's): {', '.join(f'{r:.2f}x' for r in ratios)}; "
              f"val loss difference (ours - nanoGPT's): {', '.join(f'{x:+.4f}' for x in diffs)} "
              f"(mean {statistics.mean(diffs):+.4f})")
        print(f"  tokens/s ratio at each side's 10th-percentile {WINDOW}-step window (its fast periods: a shared "
              f"machine slows either side in bursts): {', '.join(f'{r:.2f}x' for r in fast)}")
        if turns:
            paired = [cycle_ratios(n, o) for n, o in zip(nanos, runs)]
            print("  tokens/s ratio cycle by cycle (ours over nanoGPT's, each side's mean step time in its turn of "
                  "the cycle; the median over the cycles both ran steps in, their count, 10th-90th percentile): " + ", ".join(
                      f"{statistics.median(c):.2f}x over {len(c)} ({pct(c, 0):.2f}-{pct(c, -1):.2f})" for c in paired))


def cycle_ratios(nano: dict, ours: dict) -> list[float]:
    """Per cycle of turns that both sides ran steps in: the ratio of their tokens/s in it, the two
    measured seconds apart, so a change of the machine's speed between cycles cancels."""
    both = sorted(nano["cycles"].keys() & ours["cycles"].keys())
    if not both:
        raise SystemExit("no cycle of turns had steps of both sides; give a longer --turns")
    return [statistics.mean(nano["cycles"][c]) * ours["tokens_per_step"]
            / (statistics.mean(ours["cycles"][c]) * nano["tokens_per_step"]) for c in both]


def pct(values: list[float], which: int) -> float:
    """The 10th (which=0) or 90th (which=-1) percentile."""
    return statistics.quantiles(values, n=10, method="inclusive")[which] if len(values) > 1 else values[0]


def fast_tokens_per_s(run: dict) -> float:
    """Tokens/s of a run's 10th-percentile window: what it sustains while nothing else slows it."""
    windows = run["windows_ms"]
    fast = statistics.quantiles(windows, n=10, method="inclusive")[0] if len(windows) > 1 else windows[0]
    return run["tokens_per_step"] / fast * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337])
    ap.add_argument("--preset", default="", help="train this project with a preset's own recipe (steps, schedule) "
                    "instead of nanoGPT's config: time to nanoGPT's loss, e.g. presets/cpu_speedrun.yaml")
    ap.add_argument("--also-fp32", action="store_true", help="after each of our runs, the same again with "
                    "trainer.precision=fp32 (a preset's precision=auto side by side with the fp32 it falls back to)")
    ap.add_argument("--turns", type=float, default=0.0, metavar="SECONDS",
                    help="run a seed's trainings together, taking turns on the machine SECONDS each (one at a time; "
                         "outside load then slows all alike; wall times then include the others' turns); "
                         "default 0: one after the other")
    ap.add_argument("overrides", nargs="*", help="config overrides for main.py (e.g. a preset's speed settings)")
    args = ap.parse_args()
    if args.turns < 0 or 0 < args.turns < MIN_TURN_S:
        ap.exit(2, f"error: --turns must be 0 (one after the other) or at least {MIN_TURN_S:g} s: a turn keeps only "
                   f"the {WINDOW}-step windows wholly inside it, and one takes up to 0.5 s here\n")
    print(cpu_line(), flush=True)
    text = CORPUS.read_text(encoding="utf-8")
    val_text, chars = text[int(len(text) * 0.9):], sorted(set(text))  # nanoGPT's split and vocabulary
    sides = {"minGPT-parallel": args.overrides}
    if args.also_fp32:
        sides["minGPT-parallel fp32"] = [*args.overrides, "trainer.precision=fp32"]
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        scratch = scratch_nanogpt(folder)
        results = {"nanoGPT": [], **{name: [] for name in sides}}
        for seed in args.seeds:  # never two at once: one after the other, or taking turns (--turns)
            commands = [nanogpt_command(scratch, args.steps, seed)] + [
                ours_command(folder, args.steps, seed, extra, args.preset, tag=f"ours{i}")
                for i, extra in enumerate(sides.values())]
            rows = [nanogpt_rows] + [lambda _, run=our_run(folder, f"ours{i}", seed): our_rows(run)
                                     for i in range(len(sides))]
            finished = run_processes(commands, args.threads, args.turns, rows)
            nano = nanogpt_result(finished[0], scratch, seed, eval_interval(args.steps))
            nano["val"] = nanogpt_val_loss(scratch, nano["ckpt"], val_text, chars)
            results["nanoGPT"].append(nano)
            for i, (name, r) in enumerate(zip(sides, finished[1:])):
                ours = ours_result(r, our_run(folder, f"ours{i}", seed))
                ours["val"] = our_val_loss(ours["model"], val_text)
                results[name].append(ours)
    print(f"\n=== {args.steps} steps of nanoGPT's CPU config, {args.threads} threads, seeds {args.seeds}"
          f"{', ours with ' + args.preset if args.preset else ''}"
          f"{', overrides ' + ' '.join(args.overrides) if args.overrides else ''}")
    print(cpu_line())
    report(results, args.seeds, args.turns)


if __name__ == "__main__":
    main()
