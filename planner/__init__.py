"""Predict what a parallel layout costs before any process is launched: `python main.py --plan`.

The public names of the planner (this package), for main.py, benchmarks/strategy_report.py and the tests:
`plan(cfg, world_size, device_memory, hardware, reserve)` returns a `Plan`, one `LayoutPlan` per
layout (the configured one first, then every alternative the launch's checks accept, fitting and
fastest first), each with its predicted step time, tokens/s and MFU on `hardware`, and the
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
    traffic.py      tensor-, pipeline- and context-parallel traffic
    layout_plan.py  one layout: plan_layout
    alternatives.py every layout of a world size: check_layout, plan (ranked by predicted time)
    hardware.py     `--hardware NAME|FILE`: the devices, links and peaks a step time is predicted for
    local_hardware.py `--hardware local`: this machine's figures as tools/calibrate.py cached them
    compute.py      one pipeline rank's compute, recomputation and split backward; a zero-bubble step's idle
    timing.py       one layout's step time: compute, bubble, communication, optimizer
    advice.py       nothing fits: which knobs make what fit
    render.py       the text table and its legend
"""
from __future__ import annotations

from planner.advice import fit_advice
from planner.alternatives import DataParallelChoice, check_layout, plan, refuse_unpriced
from planner.hardware import Hardware, load_hardware
from planner.inventory import gpt_config, parameter_inventory, vocab_size
from planner.layout_plan import plan_layout
from planner.records import Collective, LayoutPlan, Plan, PlannedLayout, RankMemory, StepTime
from planner.render import host_memory_note, render
from planner.schedule import inflight_per_stage
from planner.units import default_reserve, fmt_bytes, numel, parse_bytes

__all__ = ["Collective", "DataParallelChoice", "Hardware", "LayoutPlan", "Plan", "PlannedLayout", "RankMemory",
           "StepTime", "check_layout", "default_reserve", "fit_advice", "fmt_bytes", "gpt_config", "host_memory_note",
           "inflight_per_stage", "load_hardware", "numel", "parameter_inventory", "parse_bytes", "plan", "plan_layout",
           "refuse_unpriced", "render", "vocab_size"]
