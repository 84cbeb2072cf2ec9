"""Predict what a parallel layout costs before any process is launched: `python main.py --plan`.

The public names of the planner, for main.py, benchmarks/strategy_report.py and the tests:
`plan(cfg, world_size, device_memory)` returns a `Plan`, one `LayoutPlan` per layout (the
configured one first, then every alternative the launch's checks accept), each with the
predicted per-rank bytes of parameters, gradients, optimizer state, activations, transients and
communication buffers, and the bytes each collective moves per optimizer step; `render` prints
it, `Plan.to_json` writes it. Pure arithmetic on the config: no process group, no tensors.

Where each part lives (docs/planner.md has the formulas and their measurement):
    records.py      the dataclasses: PlannedLayout, Collective, RankMemory, LayoutPlan, Plan
    units.py        parse_bytes, fmt_bytes, numel, ceil_div
    inventory.py    model.py's parameters, their tensor-parallel shapes, their pipeline ranks
    activations.py  bytes saved for backward (Korthikanti et al. 2022, adapted to SDPA), transients
    schedule.py     micro-batches in flight per pipeline schedule, bubble fraction
    engines.py      each data-parallel engine's memory and traffic (the ZeRO paper's formulas)
    traffic.py      tensor- and pipeline-parallel traffic
    layout_plan.py  one layout: plan_layout
    alternatives.py every layout of a world size: check_layout, plan
    render.py       the text table and its legend
"""
from __future__ import annotations

from costs.alternatives import DataParallelChoice, check_layout, plan
from costs.inventory import gpt_config, parameter_inventory, vocab_size
from costs.layout_plan import plan_layout
from costs.records import Collective, LayoutPlan, Plan, PlannedLayout, RankMemory
from costs.render import render
from costs.schedule import inflight_per_stage
from costs.units import fmt_bytes, numel, parse_bytes

__all__ = ["Collective", "DataParallelChoice", "LayoutPlan", "Plan", "PlannedLayout", "RankMemory", "check_layout",
           "fmt_bytes", "gpt_config", "inflight_per_stage", "numel", "parameter_inventory", "parse_bytes", "plan",
           "plan_layout", "render", "vocab_size"]
