"""`python main.py --dry-run --world-size N [overrides]`: the real code of a launch of N ranks, run
for every distinct rank role in this one process (tools/fake_world.py), beside the planner's
prediction for the same ranks.

Roles: one pp rank per distinct set of stages (first, middle and last stage, and any stage with
another block count), each at the first and the last dp and tp position (the last ones hold the
shorter chunks of an uneven split) and, under context parallelism, the first and the last cp
position (each holds two chunks of every sequence: the same figures, compared both ways). Per
simulated rank it compares parameters, gradients and Adam state (Strategy.resident_bytes), bytes
saved for backward per micro-batch (SavedBytes), the
peak bytes allocated while the model was built, on the device and in host memory (AllocationPeak:
"construction", "construction host") and bytes moved per collective kind (CollectiveCounter, ring
volumes; the gradient norm's small reductions are listed, not compared; cp attention's sends
and collectives as kind "cp": tools/measure.py cp_phase) with `planner`'s figures
of that pp rank. The planner predicts the fullest position (dp 0, tp 0): there a figure must agree
within 1% both ways; at the last positions it must not exceed the prediction by more than 1%. The
construction is the planner's figure of the rank's own sharding position (FSDP2's padded copy of
a partial chunk makes a later position the fullest one). Exit 0 when every figure
agrees, 1 naming each disagreement (rank, category, both figures); a layout the launch's checks
refuse is a UsageError (exit 2), as training would refuse it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from config import Config, UsageError
from parallel.layout import Layout
from parallel.options import Engine
from planner.activations import activation_model
from planner.alternatives import check_layout, refuse_unplanned_optimizer
from planner.engines import engine_costs
from planner.inventory import gpt_config, held_tensors, vocab_size
from planner.layout_plan import construction_bytes, rank_collectives, rank_memory
from planner.records import PlannedLayout
from planner.schedule import inflight_per_stage
from planner.units import fmt_bytes
from tools.fake_world import RankMeasurement, fake_world, measure_rank, start_rank
from tools.measure import PLANNED_KINDS, planner_kind

TOLERANCE = 0.01  # a figure further than 1% from the planner's is a disagreement


@dataclass
class Figure:
    category: str  # params | grads | optimizer | activations | construction | construction host | moved <kind>
    planned: float
    measured: float
    at_most: bool  # a last dp/tp position: the planner's figure is the fullest position's, an upper bound

    @property
    def agrees(self) -> bool:
        if self.at_most:
            return self.measured <= self.planned * (1 + TOLERANCE)
        return abs(self.measured - self.planned) <= TOLERANCE * max(self.planned, 1.0)


@dataclass
class RankReport:
    rank: int
    coordinate: tuple[int, ...]  # (pp, dp, tp), and cp under context parallelism
    seconds: float
    figures: list[Figure]
    collectives: dict[str, dict]  # "kind on group (n ranks)" -> calls, payload, moved
    snapshot_items: int
    snapshot_bytes: int


@dataclass
class DryRunReport:
    world_size: int
    layout: str
    ranks: list[RankReport] = field(default_factory=list)
    seconds: float = 0.0

    def disagreements(self) -> list[tuple[RankReport, Figure]]:
        return [(r, f) for r in self.ranks for f in r.figures if not f.agrees]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def role_ranks(lay: Layout) -> list[int]:
    """Global ranks of the distinct roles (module doc), in rank order."""
    last = lay.num_stages - 1
    seen, pp_ranks = set(), []
    for r in range(lay.pp):
        key = tuple((lay.stage_blocks[s], s == 0, s == last) for s in lay.stages_of(r))
        if key not in seen:
            seen.add(key)
            pp_ranks.append(r)
    return sorted({lay.rank_of(p, d, t, c) for p in pp_ranks for d in {0, lay.dp - 1} for t in {0, lay.tp - 1}
                   for c in {0, lay.cp - 1}})


def predictions(cfg: Config, lay: PlannedLayout, vocab: int) -> list[tuple[dict[str, int], dict[str, int], Callable]]:
    """Per pp rank, the planner's (memory by category, bytes moved by collective kind, construction
    bytes at a sharding position), as planner.layout_plan.plan_layout computes them for every pp
    rank. The construction's fullest position is not always the first (FSDP2 pads a partial chunk
    into a new buffer): each simulated rank is compared with the planner's figure of its position."""
    g = gpt_config(cfg, vocab)
    engine, am = engine_costs(lay, cfg.parallel), activation_model(cfg, lay.strategy)
    inflight = inflight_per_stage(lay) if lay.pp > 1 else [{0: 1}]
    out = []
    for r, held in enumerate(held_tensors(g, lay)):
        mem = rank_memory(g, lay, am, engine, r, held, inflight[r])
        moved: dict[str, int] = {}
        for c in rank_collectives(g, lay, am, engine, held, sorted(inflight[r])):
            moved[c.kind] = moved.get(c.kind, 0) + c.moved_bytes
        out.append(({"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                     "activations": mem.activations_per_microbatch, "construction": mem.construction,
                     "construction host": mem.construction_host}, moved,
                    functools.partial(construction_bytes, held, engine, engine.model_state(held))))
    return out


def compare(m: RankMeasurement, planned: tuple[dict[str, int], dict[str, int], Callable], lay: PlannedLayout) -> list[Figure]:
    memory, moved, built_at = planned
    # the engine's sharding position: dp x cp flattened under cp (dp-major, as the mesh flattens it)
    position = m.coordinate[1] * lay.cp + (m.coordinate[3] if lay.cp > 1 else 0)
    memory = {**memory, "construction": built_at(position % lay.dp_shard)[0]}
    # a later dp or tp position, or a later cp position of an engine that shards over dp x cp,
    # holds at most the fullest (first) position's share
    sharded_cp = lay.strategy in (Engine.FSDP, Engine.ZERO3) and position % lay.dp_shard != 0
    at_most = m.coordinate[1] != 0 or m.coordinate[2] != 0 or sharded_cp
    measured = {**m.held, "activations": m.activations_per_microbatch, "construction": m.construction,
                "construction host": m.construction_host}
    figures = [Figure(k, memory[k], measured.get(k, 0), at_most) for k in memory]
    got: dict[str, float] = {}
    for c in m.calls:
        kind = planner_kind(c, m.groups)
        got[kind] = got.get(kind, 0.0) + c.moved
    for kind in sorted(set(moved) | {k for k in got if k in PLANNED_KINDS} | {k for k in got if " on " in k}):
        figures.append(Figure(f"moved {kind}", moved.get(kind, 0), got.get(kind, 0.0), at_most))
    return figures


def collective_summary(m: RankMeasurement) -> dict[str, dict]:
    """Every collective of the step by type and group size: calls, payload and ring volume."""
    out: dict[str, dict] = {}
    for c in m.calls + m.snapshot_calls:
        key = f"{c.kind} on {m.groups.get(c.ranks, 'group')} ({len(c.ranks)} ranks)" + \
            (f", {c.phase}" if c.phase else "")
        row = out.setdefault(key, {"calls": 0, "payload": 0, "moved": 0.0})
        row["calls"] += 1
        row["payload"] += c.payload
        row["moved"] += c.moved
    return out


def dry_run(cfg: Config, world: int) -> DryRunReport:
    """Simulate every role of cfg's layout on `world` ranks (UsageError if the launch checks refuse it)."""
    lay = check_layout(cfg, world)
    vocab, _ = vocab_size(cfg)
    planned = predictions(cfg, lay, vocab)
    report = DryRunReport(world, lay.name)
    t0 = time.perf_counter()
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # 2-D norm advice
    with fake_world(), warnings.catch_warnings():
        # torch's own code reads a fake tensor's data pointer (a deprecation warning per run)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        for rank in role_ranks(Layout.of(cfg, world)):
            t1 = time.perf_counter()
            m = measure_rank(cfg, world, rank, vocab)
            report.ranks.append(RankReport(rank, m.coordinate, round(time.perf_counter() - t1, 2),
                                           compare(m, planned[m.coordinate[0]], lay), collective_summary(m),
                                           m.snapshot_items, m.snapshot_bytes))
        start_rank(1, 0)  # leave no process group of the simulated world behind
    report.seconds = round(time.perf_counter() - t0, 2)
    return report


def render(report: DryRunReport) -> str:
    cp = any(len(r.coordinate) > 3 for r in report.ranks)
    lines = [f"dry run: world {report.world_size} = {report.layout} | {len(report.ranks)} simulated ranks | "
             f"{report.seconds:.1f} s (torch's fake process group, FakeTensorMode)",
             f"{'rank':>5}  {'pp,dp,tp' + (',cp' if cp else ''):<10} {'category':<24} {'planned':>12} "
             f"{'measured':>12}  agree"]
    for r in report.ranks:
        where = ",".join(map(str, r.coordinate))
        for f in r.figures:
            mark = "yes" if f.agrees else "NO"
            lines.append(f"{r.rank:>5}  {where:<10} {f.category:<24} {fmt_bytes(f.planned):>12} "
                         f"{fmt_bytes(round(f.measured)):>12}  {mark}{' (<=)' if f.at_most else ''}")
        lines.append(f"{'':>5}  {where:<10} snapshot plan: {r.snapshot_items} DCP write items, "
                     f"{fmt_bytes(r.snapshot_bytes)}; collectives: " +
                     "; ".join(f"{k} x{v['calls']} {fmt_bytes(v['payload'])}" for k, v in r.collectives.items()))
    bad = report.disagreements()
    for r, f in bad:
        lines.append(f"disagreement: rank {r.rank} (pp {r.coordinate[0]}, dp {r.coordinate[1]}, tp "
                     f"{r.coordinate[2]}{f', cp {r.coordinate[3]}' if cp else ''}) {f.category}: "
                     f"planned {fmt_bytes(f.planned)}, measured "
                     f"{fmt_bytes(round(f.measured))}")
    lines.append("every figure agrees within 1%" if not bad else f"{len(bad)} figure(s) disagree by more than 1%")
    return "\n".join(lines)


def dry_run_command(cfg: Config, world: int, plan_json: str | None) -> int:
    """main.py --dry-run: print the comparison (and write it as JSON); 0 if it agrees, else 1."""
    if cfg.trainer.precision == "fp16":
        raise UsageError("the dry run does not cover fp16: its grad scaler reads its inf check with .item(), "
                         "which fake tensors have no value for; use trainer.precision=bf16 (same memory)")
    refuse_unplanned_optimizer(cfg)
    report = dry_run(cfg, world)
    if plan_json:
        try:
            Path(plan_json).write_text(report.to_json(), encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--plan-json '{plan_json}' cannot be written ({e.strerror}); "
                             f"give a path in a writable folder") from None
    print(render(report), flush=True)
    return 1 if report.disagreements() else 0
