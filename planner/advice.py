"""When no layout fits the device memory: which knobs make what fit, with the figures.

`fit_advice` plans the same job again with each knob turned: smaller micro-batches (fewer
activations in flight: trainer.micro_batch_size), activation checkpointing, both, context
parallelism (parallel.cp = 2, 4, 8 where the world size and the block split, one sequence per
micro-batch: the activations of s/cp tokens), and
more ranks (2x and 4x the world size), and names for each the fastest layout that fits, its peak and its
predicted step time (or says that it still does not fit).
"""
from __future__ import annotations

import copy

from config import Config, UsageError
from planner.alternatives import cp_degrees, plan
from planner.hardware import Hardware
from planner.render import display_name, fmt_seconds
from planner.units import fmt_bytes

MICRO_BATCHES = (8, 4, 2, 1)


def knobs(cfg: Config, world: int) -> list[tuple[str, dict, int]]:
    """(overrides as text, {section.key: value}, world size) of every variant worth planning."""
    out = []
    now = cfg.trainer.micro_batch_size
    smaller = [m for m in MICRO_BATCHES if now == 0 or m < now]
    for m in smaller[:2] + smaller[-1:] if len(smaller) > 2 else smaller:
        out.append((f"trainer.micro_batch_size={m}", {"trainer.micro_batch_size": m}, world))
    if not cfg.parallel.activation_checkpointing:
        out.append(("parallel.activation_checkpointing=true", {"parallel.activation_checkpointing": True}, world))
        if smaller:
            m = smaller[0]
            out.append((f"parallel.activation_checkpointing=true trainer.micro_batch_size={m}",
                        {"parallel.activation_checkpointing": True, "trainer.micro_batch_size": m}, world))
    if cfg.parallel.cp == 1:
        # each sequence over c ranks: a rank holds the activations of s/c tokens of each of its
        # sequences; at one world size cp takes ranks from dp, so each rank has c times the
        # sequences: one per micro-batch is what brings its tokens below one whole sequence's
        for c in cp_degrees(cfg, world):
            out.append((f"parallel.cp={c} trainer.micro_batch_size=1",
                        {"parallel.cp": c, "trainer.micro_batch_size": 1}, world))
    for k in (2, 4):
        out.append((f"--world-size {world * k}", {}, world * k))
    return out


def fit_advice(cfg: Config, world: int, device_memory: int, hardware: Hardware | None, reserve: int) -> list[str]:
    lines = ["nothing fits; what would (the fastest layout that fits with each change):"]
    for text, changes, size in knobs(cfg, world):
        variant = copy.deepcopy(cfg)
        for dotted, value in changes.items():
            section, key = dotted.split(".")
            setattr(getattr(variant, section), key, value)
        try:
            result = plan(variant, size, device_memory, hardware, reserve)
        except UsageError as e:
            lines.append(f"  {text}: refused ({e})")
            continue
        fitting = [lp for lp in result.layouts if lp.fits]
        if not fitting:
            smallest = min((lp.memory.peak for lp in result.layouts), default=0)
            lines.append(f"  {text}: still nothing fits" + (f" (smallest peak {fmt_bytes(smallest)})" if smallest else
                                                             " (no layout runs)"))
            continue
        best = fitting[0]
        step = f", step {fmt_seconds(best.time.step_s)}" if best.time else ""
        lines.append(f"  {text}: {len(fitting)} layouts fit, e.g. {display_name(best)} "
                     f"(mb {best.layout.micro_batch_size} x {best.layout.microbatches}) at {fmt_bytes(best.memory.peak)}{step}")
    return lines
