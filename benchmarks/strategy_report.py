"""Predicted vs measured, per layout: what every layout that fits N processes holds, moves and costs.

    python benchmarks/strategy_report.py --nproc 4 --out docs/report-n4
    python benchmarks/strategy_report.py --nproc 2 --out /tmp/r2 --layouts "ddp dp2,pp2 1f1b" model.n_layer=4

One torchrun launch (CPU, gloo, all ranks on this machine, holding the machine-wide multi-process
lock the tests use) trains every layout in turn in the same process group: the data-parallel
strategies (ddp, zero-1/2/3, fsdp with and without reshard_after_forward), tensor parallelism,
pipeline parallelism with each schedule, context parallelism in both modes (ring, allgather), and
the 2-D meshes that fit N. Per layout, after one
warm-up step:

- one step measured: parameters, gradients and Adam state read from the strategy's own tensors
  (Strategy.resident_bytes) after its backward; the bytes saved for backward per micro-batch
  (measure.SavedBytes); every collective the strategy issued with its payload bytes, counted at the
  dispatcher (measure.CollectiveCounter: the c10d ops that DDP's C++ reducer, FSDP2, the project's
  ZeRO and the pipeline issue, and the functional collectives of DTensor);
- the peak of tensor bytes the process really holds through the third step, with nothing else
  attached (held_memory.HeldPeak: on CPU torch.profiler's memory events from before the model is
  built, so DDP's buckets, FSDP2's gathered parameters and autograd's temporaries count too; on
  CUDA the allocator's max_memory_allocated), beside the planned peak;
- REPEATS runs of at least STEPS steps timed with nothing attached, each run at least MIN_RUN_MS long
  (the steps per run set from one timed step, the same on every rank: on a shared 2-core machine a
  run of 2 steps of 15 ms is shorter than the scheduler's bursts), under `trainer.host_memory=reuse`
  (MODEL: the time model prices steps that reuse their memory; the default, lean, maps each large
  temporary afresh every step: 1.29-1.48x the plan at 4 x 256): step time (the median run), tokens/s,
  the predicted step time (planner/timing.py on `--hardware local`, what `--plan` ranks by), the pipeline bubble (1 - the stage's
  compute time / the schedule step's time, mean over ranks) and the bytes the loopback interface
  transmitted per step (every rank's traffic, TCP/IP headers included; approximate when anything
  else uses `lo`, which the lock keeps to the launcher's own store traffic).

The same config goes through planner.plan_layout, and report.json / report.md put prediction and
measurement side by side: memory categories must agree within 5% and bytes moved within 2%
(payload issued, converted to a ring's volume per rank), the peak really held is shown against the
planned one with its own bar (PEAK_BAR); PNG plots show the same. Extra arguments
are config overrides of the report's model (MODEL below).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)
import matplotlib
import matplotlib.pyplot as plt
import torch

import planner
from checks import load_config
from config import UsageError
from launch.errors import reject_dashed_overrides
from observe.host_memory import return_large_frees, reuse_step_memory
from planner.hardware import Hardware
from testing.local import CORPUS, torchrun_until
from tools.calibrate import measure_local
from tools.held_memory import HeldPeak
from tools.measure import (
    PLANNED_KINDS,
    CollectiveCounter,
    SavedBytes,
    StageClock,
    add_timer,
    cp_phase,
    loopback_tx_bytes,
    norm_phase,
    planner_kind,
)

matplotlib.use("Agg")  # files only, no display (pyplot switches to it: no figure exists yet)

# small enough for 4 processes on 2 cores, 8 blocks so that pp=4 can hold 2 stages per rank
MODEL = [f"data.path={CORPUS}", "data.truncate=200000", "model.n_layer=8", "model.n_head=4", "model.n_embd=64",
         "model.block_size=32", "model.dropout=0.0", "trainer.batch_size=16", "trainer.micro_batch_size=0",
         "trainer.eval_every=1000", "trainer.save_every=0", "trainer.sample_tokens=0", "trainer.resume=never",
         "trainer.device=cpu", "wandb.enabled=false",
         # the time model prices steps that reuse their memory: lean's fresh mappings are not in it
         # (1.29-1.48x the plan at 4 x 256 on 2 processes, docs/planner.md)
         "trainer.host_memory=reuse"]
MEMORY = ("params", "grads", "optimizer", "activations_per_microbatch")
KINDS = PLANNED_KINDS
MEMORY_BAR, BYTES_BAR, TIME_BAR = 0.05, 0.02, 0.20
MIN_RUN_MS = 250.0  # a timed run's least length: 10+ of a 2-core VM's scheduling bursts average out
PEAK_BAR = 0.15  # the planned peak (a sum of what is live at once) against the peak really held
SLACK = 64  # bytes: a category predicted as 0 may measure this much


def layouts(n: int) -> dict[str, str]:
    """name -> overrides of every layout to try on n processes (check_layout drops what does not fit)."""
    out = {
        f"ddp dp{n}": "parallel.strategy=ddp",
        f"zero-1 dp{n}": "parallel.strategy=zero parallel.zero_stage=1",
        f"zero-2 dp{n}": "parallel.strategy=zero parallel.zero_stage=2",
        f"zero-3 dp{n}": "parallel.strategy=zero parallel.zero_stage=3",
        f"fsdp dp{n}": "parallel.strategy=fsdp",
        f"fsdp no-reshard dp{n}": "parallel.strategy=fsdp parallel.reshard_after_forward=false",
        f"tp{n}": f"parallel.strategy=none parallel.tp={n}",
        f"tp{n} +sp +vocab": f"parallel.strategy=none parallel.tp={n} parallel.sequence_parallel=true "
                            "parallel.tp_vocab_parallel=true",
    }
    # context parallelism: each sequence over the n ranks, the runner averaging the gradients over cp
    out.update({f"cp{n} {mode}": f"parallel.strategy=none parallel.cp={n} parallel.cp_mode={mode}"
                for mode in ("ring", "allgather")})
    pp = f"parallel.strategy=none parallel.pp={n} parallel.microbatches={2 * n}"
    out.update({
        f"pp{n} gpipe": f"{pp} parallel.pp_schedule=gpipe",
        f"pp{n} 1f1b": f"{pp} parallel.pp_schedule=1f1b",
        f"pp{n} interleaved v2": f"{pp} parallel.pp_schedule=interleaved_1f1b parallel.pp_stages_per_rank=2",
        f"pp{n} zero-bubble": f"{pp} parallel.pp_schedule=zero_bubble",
        f"pp{n} zero-bubble V": f"{pp} parallel.pp_schedule=zero_bubble parallel.pp_stages_per_rank=2",
    })
    if n % 2 == 0 and n > 2:
        h = n // 2
        out.update({
            f"hsdp dp2x{h}": "parallel.strategy=fsdp parallel.dp_replicate=2",
            f"fsdp dp{h} x tp2": "parallel.strategy=fsdp parallel.tp=2",
            f"ddp dp{h} x pp2 1f1b": "parallel.strategy=ddp parallel.pp=2 parallel.microbatches=4",
            f"tp2 x pp{h} 1f1b":
                f"parallel.strategy=none parallel.tp=2 parallel.pp={h} parallel.microbatches={2 * h}",
        })
    return out


def config(overrides: list[str], run_dir: Path):
    return load_config(None, MODEL + overrides + [f"trainer.run_dir={run_dir}"])


# ----------------------------------------------------------------------------- worker (each rank)


def steps_per_run(trainer, steps: int, min_run_s: float) -> int:
    """At least `steps`, and enough that one run lasts `min_run_s`: one step timed barrier to barrier,
    rank 0's count broadcast (every rank must run as many steps)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    trainer.train_step()
    dist.barrier()
    count = torch.tensor([max(steps, math.ceil(min_run_s / (time.perf_counter() - t0)))])
    dist.broadcast(count, 0)
    return int(count)


def measure_layout(overrides: list[str], run_dir: Path, steps: int, repeats: int, min_run_s: float) -> dict:
    import torch.distributed as dist

    from launch.build import build_trainer
    from parallel.env import init_distributed
    from tools.fake_world import group_names

    cfg = config(overrides, run_dir)
    env = init_distributed(cfg)
    saved = SavedBytes()
    counter = CollectiveCounter()
    # what the process really holds, seen from before the model exists (every tensor's allocation),
    # through the third step: not the measured one, whose SavedBytes keeps every saved tensor alive
    # from the first step to the last timed one, closed below (an error ends the worker's process,
    # glibc's setting with it)
    stepping = contextlib.ExitStack()
    with HeldPeak(env.device) as held:
        trainer = build_trainer(cfg, env, run_dir)
        # built lean, its steps as trainer.host_memory says, as main.py runs (observe/host_memory.py)
        stepping.enter_context(reuse_step_memory(cfg.trainer.host_memory == "reuse"))
        s = trainer.strategy
        for _ in range(2):  # warm-up: a pipeline infers its shapes, DDP rebuilds its buckets (a broadcast)
            trainer.train_step()
        with held.window():
            trainer.train_step()
    with counter, norm_phase(s, counter), cp_phase(counter):
        with saved.hooks():
            trainer.forward_backward()
        memory = s.resident_bytes(trainer.optimizer)
        trainer.optimizer_step()
    groups = group_names(s)  # the dry run reads the groups the same way
    by_kind: dict[str, dict[str, float]] = {}
    ops: dict[str, int] = {}
    for c in counter.calls:
        k = planner_kind(c, groups)
        row = by_kind.setdefault(k, {"payload": 0, "moved": 0.0, "calls": 0})
        row["payload"] += c.payload
        row["moved"] += c.moved
        row["calls"] += 1
        ops[c.op] = ops.get(c.op, 0) + 1
    pipe = s.runner if s.layout.pp > 1 else None
    clock = StageClock(pipe) if pipe else None
    sched = [0.0]
    if pipe:
        add_timer(pipe.schedule, "step", sched)
    steps = steps_per_run(trainer, steps, min_run_s)
    chunks = []  # mean step time of each of `repeats` runs of `steps` steps, barrier to barrier
    wire0 = loopback_tx_bytes()
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        dist.barrier()
        chunks.append((time.perf_counter() - t0) / steps)
    stepping.close()  # glibc back to returning large frees, the kept memory trimmed: the next layout builds lean
    seconds, wire = statistics.median(chunks), (loopback_tx_bytes() - wire0) / (steps * repeats)
    mine = {**memory, "activations_per_microbatch": saved.nbytes // s.layout.microbatches,
            "held_start": held.start, "held_peak": held.peak,
            "pp_rank": s.coordinate.pp, "collectives": by_kind, "ops": ops,
            "busy": clock.busy[0] if clock else 0.0, "schedule_s": sched[0]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    bubble = (statistics.mean(1 - r["busy"] / max(x["schedule_s"] for x in everyone) for r in everyone)
              if pipe else None)
    return {"ranks": everyone, "step_s": seconds, "step_runs_s": chunks, "steps_per_run": steps,
            "wire_bytes_per_step": wire, "bubble": bubble}


def worker(args) -> None:
    import torch.distributed as dist

    results = {}
    tmp = Path(tempfile.mkdtemp(prefix="strategy-report-"))
    return_large_frees()  # as main.py starts (observe/host_memory.py)
    for i, (name, overrides) in enumerate(args.case):
        results[name] = measure_layout(overrides.split(), tmp / f"run{i}", args.steps, args.repeats,
                                       args.min_run_ms / 1000)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(results))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- comparison


@dataclass
class Check:
    what: str  # e.g. "params pp0" or "all-reduce"
    predicted: float
    measured: float
    bar: float

    @property
    def ratio(self) -> float | None:
        return self.measured / self.predicted if self.predicted else None

    @property
    def ok(self) -> bool:
        if not self.predicted:
            return self.measured <= SLACK
        return abs(self.measured / self.predicted - 1) <= self.bar


@dataclass
class LayoutReport:
    name: str
    overrides: str
    planned_name: str
    memory: list[Check]  # per pp rank and category, the fullest rank of that pp rank measured
    moved: list[Check]  # per planner kind, the busiest rank, bytes per step (ring volume of the payload)
    payload: dict[str, dict]  # measured by kind: payload, moved, calls (busiest rank)
    ops: dict[str, int]  # dispatcher ops seen on rank 0
    moved_total_predicted: int
    moved_total_measured: float  # ring volumes of the measured payloads, all ranks
    wire_bytes_per_step: float  # loopback, all ranks
    step_s: float  # the median of the timed runs
    step_runs_s: list[float]  # each run's mean step time
    steps_per_run: int  # at least --steps, enough for --min-run-ms (0: a measurement made before it was kept)
    step_predicted_s: float  # planner/timing.py on --hardware local
    time_terms: list[tuple[str, float]]  # the prediction's terms: name, exposed seconds
    tokens_per_s: float
    bubble_predicted: float | None
    bubble_measured: float | None
    fullest_pp_rank: int
    peak: list[Check] = field(default_factory=list)  # per pp rank: planned peak vs the most really held
    held_start: list[int] = field(default_factory=list)  # per pp rank: really held when the step began
    peak_terms: list[dict[str, int]] = field(default_factory=list)  # per pp rank: the planned peak's sum
    ok: bool = field(default=False)

    @property
    def peak_ok(self) -> bool:
        return all(c.ok for c in self.peak)

    @property
    def time_ratio(self) -> float:
        return self.step_s / self.step_predicted_s

    @property
    def time_ok(self) -> bool:
        return abs(self.time_ratio - 1) <= TIME_BAR


def compare(name: str, overrides: str, got: dict, user: list[str], n: int, hw: Hardware) -> LayoutReport:
    cfg = config(overrides.split() + user, Path(tempfile.gettempdir()) / "strategy-report-plan")
    g = planner.gpt_config(cfg, planner.vocab_size(cfg)[0])
    lp = planner.plan_layout(cfg, g, planner.check_layout(cfg, n), True, None, hw)
    ranks = got["ranks"]
    memory, peak, start, terms = [], [], [], []
    for want in lp.per_pp_rank:
        mine = [r for r in ranks if r["pp_rank"] == want.pp_rank]
        for key in MEMORY:
            memory.append(Check(f"{key} pp{want.pp_rank}", getattr(want, key), max(r[key] for r in mine), MEMORY_BAR))
        # the least of the ranks holding the same share: a free on a thread the profiler does not
        # follow (gloo's) goes unseen and can only add (held_memory.HeldPeak)
        peak.append(Check(f"peak pp{want.pp_rank}", want.peak, min(r["held_peak"] for r in mine), PEAK_BAR))
        start.append(min(r["held_start"] for r in mine))
        terms.append({"params + grads + Adam": want.params + want.grads + want.optimizer, "buffers": want.buffers,
                      "activations in flight": want.activations, "transient": want.transient})

    def moved(r):
        return sum(v["moved"] for k, v in r["collectives"].items() if k in KINDS)
    busiest = max(ranks, key=moved)
    kinds = sorted(set(lp.moved_bytes_per_rank) | {k for k in busiest["collectives"] if k in KINDS}
                   | {k for r in ranks for k in r["collectives"] if k.startswith("other")}, key=str)
    checks = [Check(k, lp.moved_bytes_per_rank.get(k, 0), busiest["collectives"].get(k, {}).get("moved", 0.0),
                    BYTES_BAR) for k in kinds]
    checks.append(Check("total, all ranks", lp.moved_bytes_total, sum(moved(r) for r in ranks), BYTES_BAR))
    tokens = cfg.trainer.batch_size * cfg.model.block_size
    rep = LayoutReport(name, overrides, lp.name, memory, checks, busiest["collectives"], ranks[0]["ops"],
                       lp.moved_bytes_total, sum(moved(r) for r in ranks), got["wire_bytes_per_step"],
                       got["step_s"], got["step_runs_s"], got.get("steps_per_run", 0), lp.time.step_s,
                       [(t.name, t.exposed) for t in lp.time.terms], tokens / got["step_s"], lp.bubble if lp.layout.pp > 1 else None,
                       got["bubble"], lp.memory.pp_rank, peak, start, terms)
    rep.ok = all(c.ok for c in memory + checks)
    return rep


# ----------------------------------------------------------------------------- output


def mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


def ratio(c: Check) -> str:
    return f"{c.ratio:.3f}" if c.ratio is not None else ("-" if not c.measured else "unpredicted")


def _ranking(reps: list[LayoutReport]) -> str:
    """How many pairs of layouts the prediction orders as the measurement does (pairs whose
    measured runs overlap are ties: either order agrees)."""
    pairs = same = 0
    for i, a in enumerate(reps):
        for b in reps[i + 1:]:
            pairs += 1
            overlap = min(a.step_runs_s) <= max(b.step_runs_s) and min(b.step_runs_s) <= max(a.step_runs_s)
            same += overlap or (a.step_s < b.step_s) == (a.step_predicted_s < b.step_predicted_s)
    return f"{same} of {pairs} pairs ordered alike (pairs whose measured runs overlap count as ties)"


def _peak_table(reps: list[LayoutReport]) -> list[str]:
    out = ["## Peak memory per rank (MB): planned vs really held", "",
           "Planned: planner.plan_layout's peak, the sum of what it expects live at once. Really held: the "
           "tensor bytes the process holds through one training step (the third; none of the measurement "
           "hooks attached), read from the allocator's side (tools/held_memory.py HeldPeak: torch.profiler's "
           "memory events on CPU, from before the model is built, so DDP's buckets, FSDP2's gathered "
           "parameters, autograd's temporaries and the data order count too); the least of the ranks of "
           "the pipeline rank (a free on one of gloo's threads goes unseen by the profiler and can only add: "
           f"measured up to 4a on one ddp rank, DDP's construction broadcast). Bar: {PEAK_BAR:.0%}. Within it: {sum(r.peak_ok for r in reps)} of {len(reps)}.",
           "", "| layout | pp rank | planned: params + grads + Adam / buffers / activations / transient | "
           "planned peak | held at the step's start | held peak | held / planned |", "|---|---|---|---|---|---|---|"]
    for r in reps:
        for c, start, terms in zip(r.peak, r.held_start, r.peak_terms):
            flag = "" if c.ok else " (outside)"
            out.append(f"| {r.name} | {c.what.split()[-1]} | " + " / ".join(mb(v) for v in terms.values())
                       + f" | {mb(c.predicted)} | {mb(start)} | {mb(c.measured)} | {ratio(c)}{flag} |")
    return out + [""]


def markdown(reps: list[LayoutReport], n: int, argv: list[str], model: dict, runs: str, hw_source: str) -> str:
    """`runs`: how long a timed run is, e.g. 'at least 4 steps and 250 ms'."""
    out = [f"# Strategy report: {n} processes, predicted vs measured", "",
           f"Produced by `python benchmarks/strategy_report.py {' '.join(argv)}` (CPU, gloo, {n} processes on "
           f"one machine; timed runs of {runs} per layout after one measured step).", "",
           f"Model: {model['n_layer']} layers x {model['n_embd']} wide, {model['n_head']} heads, block "
           f"{model['block_size']}, vocabulary {model['vocab_size']}, {model['parameters']:,} parameters; global "
           f"batch {model['global_batch']} sequences, {model['precision']}.", "",
           f"Agreement bars: memory {MEMORY_BAR:.0%}, bytes moved {BYTES_BAR:.0%}. Layouts within both: "
           f"{sum(r.ok for r in reps)} of {len(reps)}.", "",
           "![memory](memory.png)", "", "![bytes moved](bytes.png)", "", "![time](time.png)", "",
           "## Memory per rank (MB = 10^6 bytes), the fullest pipeline rank", "",
           "Predicted by planner.plan_layout; measured from the strategy's own tensors after the backward "
           "(the most any rank of that pipeline rank holds) and, for activations, the bytes saved for "
           "backward per micro-batch. Every pipeline rank is checked; the table shows the fullest.", "",
           "| layout | params | grads | Adam | activations / micro-batch | worst ratio (all pp ranks) |",
           "|---|---|---|---|---|---|"]
    for r in reps:
        cells = []
        for key in MEMORY:
            c = next(c for c in r.memory if c.what == f"{key} pp{r.fullest_pp_rank}")
            cells.append(f"{mb(c.predicted)} / {mb(c.measured)}")
        worst = max((abs(c.ratio - 1) for c in r.memory if c.ratio is not None), default=0)
        out.append(f"| {r.name} | " + " | ".join(cells) + f" | {1 + worst:.3f} |")
    out += ["", "Cells: predicted / measured.", ""] + _peak_table(reps) + [
            "## Bytes moved per optimizer step, busiest rank (MB)", "",
            "Measured: every collective the strategy issued during the measured step, counted at the "
            "dispatcher with its payload, turned into a ring's volume per rank (all-reduce 2K(n-1)/n, "
            "reduce-scatter / all-gather / all-to-all K(n-1)/n, a send K). ZeRO-1/2 and FSDP2 reduce-scatter on "
            "gloo as an all-to-all + local sum (parallel/collectives.py), counted as reduce-scatter. The "
            "gradient norm's reductions (one fp32 per DTensor gradient, a stage's sum) are counted apart (norm), "
            "the planner leaves them out. cp: what context-parallel attention sends (tools/measure.py cp_phase: the "
            "ring's sends, allgather's all-gather and all-to-all reduce-scatter). Wire: what `lo` "
            "transmitted per step over the timed steps, all ranks together, TCP/IP headers included.", "",
           "| layout | " + " | ".join(KINDS) + " | norm (bytes) | total all ranks: "
            "planned / counted / wire | wire / planned |", "|---" * (len(KINDS) + 4) + "|"]
    for r in reps:
        cells = []
        for k in KINDS:
            c = next((c for c in r.moved if c.what == k), None)
            cells.append("-" if c is None or (not c.predicted and not c.measured) else
                         f"{mb(c.predicted)} / {mb(c.measured)} ({ratio(c)})")
        wire = r.wire_bytes_per_step / r.moved_total_predicted if r.moved_total_predicted else None
        cells.append(f"{r.payload.get('norm', {}).get('payload', 0):,}")
        out.append(f"| {r.name} | " + " | ".join(cells) + f" | {mb(r.moved_total_predicted)} / "
                   f"{mb(r.moved_total_measured)} / {mb(r.wire_bytes_per_step)} | "
                   + (f"{wire:.3f}" if wire else "-") + " |")
    out += ["", "Cells: predicted / measured (measured / predicted).", "",
            "## Time", "",
            "Step time is the median of the timed runs' mean step times (barrier to barrier, rank 0), tokens/s the "
            "global batch's tokens over it. The bubble is 1 - a rank's compute time (its stages' forward, backward and weight "
            "chunks and the loss) / the schedule step's time, averaged over ranks; prediction (p-1)/(v m+p-1) "
            "assumes one core per rank and free communication. With more processes than cores a rank waiting for "
            "a peer also waits for a core, so the measured bubble here is the schedule's plus the oversubscription's; "
            "benchmarks/pp_bubble.py at p=2 (one core per rank) measures the schedule alone.", "",
            f"Predicted: planner/timing.py on `--hardware local` ({hw_source}), the same formulas `--plan` "
            f"ranks layouts by; measured: the median of {len(reps[0].step_runs_s)} runs of {runs}. Bar: "
            f"{TIME_BAR:.0%}. Within it: {sum(r.time_ok for r in reps)} of {len(reps)}. Ranking by time: "
            f"{_ranking(reps)}.", "",
            "| layout | predicted ms | measured ms | runs (min-max) | measured / predicted | tokens/s | "
            "largest predicted terms | bubble predicted | bubble measured |", "|---|---|---|---|---|---|---|---|---|"]
    for r in reps:
        bp = f"{r.bubble_predicted:.2f}" if r.bubble_predicted is not None else "-"
        bm = f"{r.bubble_measured:.2f}" if r.bubble_measured is not None else "-"
        terms = ", ".join(f"{name} {1000 * t:.1f}" for name, t in sorted(r.time_terms, key=lambda x: -x[1])[:3])
        out.append(f"| {r.name} | {1000 * r.step_predicted_s:.1f} | {1000 * r.step_s:.1f} | "
                   f"{1000 * min(r.step_runs_s):.1f}-{1000 * max(r.step_runs_s):.1f} | {r.time_ratio:.2f}"
                   f"{'' if r.time_ok else ' (outside)'} | {r.tokens_per_s:,.0f} | {terms} | {bp} | {bm} |")
    bad = [(r.name, c) for r in reps for c in r.memory + r.moved if not c.ok]
    if bad:
        out += ["", "## Outside the bars", ""]
        out += [f"- {name}: {c.what} predicted {c.predicted:,.0f}, measured {c.measured:,.0f}" for name, c in bad]
    out += ["", "## Collectives seen at the dispatcher (rank 0, measured step)", ""]
    for r in reps:
        out.append(f"- {r.name}: " + ", ".join(f"{op} x{k}" for op, k in sorted(r.ops.items())))
    return "\n".join(out) + "\n"


def _bars(ax, names, predicted, measured, ylabel):
    x = range(len(names))
    w = 0.4
    ax.bar([i - w / 2 for i in x], predicted, w, label="predicted", color="#9bb7d4")
    ax.bar([i + w / 2 for i in x], measured, w, label="measured", color="#2b5d8a")
    ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def plots(reps: list[LayoutReport], out: Path, n: int) -> None:
    names = [r.name for r in reps]
    labels = {"params": "parameters", "grads": "gradients", "optimizer": "Adam state",
              "activations_per_microbatch": "activations / micro-batch"}
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    for ax, key in zip(axes.flat, MEMORY):
        pick = [next(c for c in r.memory if c.what == f"{key} pp{r.fullest_pp_rank}") for r in reps]
        _bars(ax, names, [c.predicted / 1e6 for c in pick], [c.measured / 1e6 for c in pick], "MB per rank")
        ax.set_title(labels[key])
    axes.flat[0].legend()
    fig.suptitle(f"Per-rank memory, predicted (planner) vs measured, {n} processes (fullest rank)")
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=70)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(13, 5))
    x = range(len(names))
    w = 0.4
    bottom_p, bottom_m = [0.0] * len(reps), [0.0] * len(reps)
    colors = dict(zip(KINDS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")))
    for k in KINDS:
        p = [next((c.predicted for c in r.moved if c.what == k), 0) / 1e6 for r in reps]
        m = [next((c.measured for c in r.moved if c.what == k), 0) / 1e6 for r in reps]
        if not any(p) and not any(m):
            continue
        ax.bar([i - w / 2 for i in x], p, w, bottom=bottom_p, color=colors[k], alpha=0.45)
        ax.bar([i + w / 2 for i in x], m, w, bottom=bottom_m, color=colors[k], label=k)
        bottom_p = [a + b for a, b in zip(bottom_p, p)]
        bottom_m = [a + b for a, b in zip(bottom_m, m)]
    ax.scatter([i + w / 2 for i in x], [r.wire_bytes_per_step / 1e6 / n for r in reps], color="black",
               marker="_", s=300, zorder=3, label="loopback wire / ranks")
    ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("MB per optimizer step, busiest rank")
    ax.set_title("Bytes moved per step by collective: left bar predicted (pale), right bar measured")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "bytes.png", dpi=70)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    _bars(a1, names, [1000 * r.step_predicted_s for r in reps], [1000 * r.step_s for r in reps], "ms per step")
    a1.errorbar([i + 0.2 for i in range(len(reps))], [1000 * r.step_s for r in reps], fmt="none", ecolor="black",
                yerr=[[1000 * (r.step_s - min(r.step_runs_s)) for r in reps],
                      [1000 * (max(r.step_runs_s) - r.step_s) for r in reps]], capsize=2)
    a1.set_title(f"Step time, predicted vs measured (median, runs min-max), {n} processes")
    a1.legend()
    pp = [r for r in reps if r.bubble_measured is not None]
    if pp:
        _bars(a2, [r.name for r in pp], [r.bubble_predicted for r in pp], [r.bubble_measured for r in pp],
              "idle fraction of a schedule step")
        a2.set_title("Pipeline bubble")
        a2.legend()
    fig.tight_layout()
    fig.savefig(out / "time.png", dpi=70)
    plt.close(fig)


def fitting(wanted: dict[str, str], user: list[str], n: int) -> tuple[dict[str, str], dict[str, str]]:
    """(the layouts of `wanted` that check_layout accepts on n processes with the overrides `user`,
    the refused ones with the reason)."""
    cases, refused = {}, {}
    for name, overrides in wanted.items():
        try:
            planner.check_layout(config(overrides.split() + user, Path("unused")), n)
            cases[name] = overrides
        except UsageError as e:
            refused[name] = str(e)
    return cases, refused


def measure(cases: dict[str, str], user: list[str], n: int, steps: int, repeats: int, min_run_ms: float,
            timeout_s: int = 900) -> dict:
    """One torchrun launch of n processes measuring every case in turn (`worker`); its results by
    layout name. Exits with the launch's stderr when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "measured.json"
        cmd = [__file__, "--json", str(raw), "--steps", str(steps), "--repeats", str(repeats),
               "--min-run-ms", str(min_run_ms)]
        for name, overrides in cases.items():
            cmd += ["--case", name, " ".join(overrides.split() + user)]
        r = torchrun_until(n, cmd, timeout_s=timeout_s, capture=True)
        if r.returncode != 0:
            sys.exit(f"error: the measuring launch failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
        return json.loads(raw.read_text())


def main() -> None:
    if "RANK" in os.environ:
        ap = argparse.ArgumentParser()
        ap.add_argument("--json", required=True)
        ap.add_argument("--steps", type=int, required=True)
        ap.add_argument("--repeats", type=int, required=True)
        ap.add_argument("--min-run-ms", type=float, required=True)
        ap.add_argument("--case", nargs=2, action="append", default=[])
        return worker(ap.parse_args())
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, required=True, help="processes (ranks) to measure")
    ap.add_argument("--out", required=True, help="folder for report.md, report.json and the plots")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per layout; the median is reported (default 5)")
    ap.add_argument("--min-run-ms", type=float, default=MIN_RUN_MS,
                    help=f"each timed run lasts at least this long (default {MIN_RUN_MS:g}): more steps per run for fast layouts")
    ap.add_argument("--layouts", default="", help="comma-separated layout names (default: all that fit)")
    ap.add_argument("overrides", nargs="*", help="config overrides of the report's model, e.g. model.n_embd=128")
    argv = sys.argv[1:]
    try:
        reject_dashed_overrides([a for a in argv if not a.startswith("--")])
    except UsageError as e:
        ap.exit(2, f"error: {e}\n")
    args = ap.parse_args()
    if args.nproc < 2:
        ap.exit(2, "error: --nproc must be >= 2 (a layout needs at least two processes)\n")
    if args.steps < 1 or args.repeats < 1 or args.min_run_ms < 0:
        ap.exit(2, "error: --steps and --repeats must be >= 1, --min-run-ms >= 0\n")
    try:
        user = config(args.overrides, Path("unused"))
        planner.refuse_unpriced(user, "strategy_report.py")
        model = planner.plan(user, 1).model
    except UsageError as e:
        ap.exit(2, f"error: {e}\n")
    wanted = layouts(args.nproc)
    if args.layouts:
        names = [x.strip() for x in args.layouts.split(",")]
        unknown = [x for x in names if x not in wanted]
        if unknown:
            ap.exit(2, f"error: unknown layout(s) {unknown}; choose from {sorted(wanted)}\n")
        wanted = {k: wanted[k] for k in names}
    cases, refused = fitting(wanted, args.overrides, args.nproc)
    if not cases:
        ap.exit(2, f"error: no layout fits {args.nproc} processes: {sorted(set(refused.values()))[:3]}\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = measure(cases, args.overrides, args.nproc, args.steps, args.repeats, args.min_run_ms)
    torch.set_num_threads(1)  # the prediction's `local` hardware: one thread per rank, as measured
    hw = planner.load_hardware("local", user.trainer.precision, measure=measure_local)
    reps = [compare(name, overrides, measured[name], args.overrides, args.nproc, hw)
            for name, overrides in cases.items()]
    (out / "report.json").write_text(json.dumps({
        "nproc": args.nproc, "model": model, "bars": {"memory": MEMORY_BAR, "bytes": BYTES_BAR, "peak": PEAK_BAR},
        "refused": refused, "hardware": hw.source,
        "layouts": [asdict(x) | {"ok": x.ok, "peak_ok": x.peak_ok, "time_ratio": x.time_ratio, "time_ok": x.time_ok}
                    for x in reps]},
        indent=1))
    runs = f"at least {args.steps} steps and {args.min_run_ms:g} ms"
    (out / "report.md").write_text(markdown(reps, args.nproc, argv, model, runs, hw.source))
    plots(reps, out, args.nproc)
    for x in reps:
        print(f"{x.name:28s} {'ok' if x.ok else 'OUTSIDE THE BARS'}  step {1000 * x.step_s:.1f} ms, "
              f"predicted {1000 * x.step_predicted_s:.1f} ms ({x.time_ratio:.2f}x{'' if x.time_ok else ', outside'})")
    print(f"wrote {out / 'report.md'}, report.json, memory.png, bytes.png, time.png")


if __name__ == "__main__":
    main()
