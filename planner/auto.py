"""`parallel.strategy=auto`: the planner picks the layout at launch (`choose_layout`).

Rank 0 plans the launched world size for every pipeline schedule, micro-batch count and
activation checkpointing on and off (each plan covers every strategy x tp x pp the launch checks
accept, under tp with the faster LM head: planner/alternatives.py head_choices), keeps the layouts that fit `parallel.device_memory` (default: the GPU's memory less the
runtime reserve; on CPU no limit unless set) and takes the fastest predicted one; when none
fits, it searches again with each sequence split over 2, 4 or 8 ranks (`parallel.cp`, the
smallest that fits); every rank gets
the resolved `parallel` section by a broadcast, so all ranks run the same layout whatever each
would measure. The resolved section, with `auto_world_size` set to the world size, is what
config.yaml records: a later launch of `parallel.strategy=auto` on the same world size into the
same run folder keeps it (the snapshot was written with it); on another world size it chooses
again and resume reshards the snapshot as for any change of layout.

Hardware: CUDA devices whose name matches a shipped description use it (A100, H100, H200; others the
A100's, with a warning), the CPU `local` (cached calibration; a launch never starts calibration processes).
"""
from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from config import Config, ParallelConfig, UsageError
from parallel.env import DistEnv
from parallel.options import Engine
from planner.alternatives import DataParallelChoice, check_layout, cp_degrees, layout_config, plan
from planner.hardware import Hardware, load_hardware
from planner.records import LayoutPlan
from planner.render import display_name, fmt_seconds
from planner.units import default_reserve, fmt_bytes, parse_bytes

SCHEDULES = ({"pp_schedule": "1f1b"}, {"pp_schedule": "gpipe"},
             {"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2})
MICROBATCHES = (0, 4, 8, 16)  # parallel.microbatches under pp (0: trainer.micro_batch_size's, else pp)


# The shipped hardware file of a GPU, by its name (torch.cuda.get_device_name), first match wins.
GPU_HARDWARE = ((r"\bG?H200\b", "h200-sxm"), (r"\bG?H100\b", "h100-sxm"), (r"\bA100\b", "a100-80gb"))
FALLBACK_GPU_HARDWARE = "a100-80gb"


def hardware_file_of(gpu_name: str) -> str | None:
    """The shipped hardware file for a GPU's name, or None when none describes it."""
    return next((spec for pattern, spec in GPU_HARDWARE if re.search(pattern, gpu_name)), None)


def hardware_for(env: DistEnv, precision: str) -> Hardware:
    if env.device.type == "cuda":
        name = torch.cuda.get_device_name(env.device)
        spec = hardware_file_of(name)
        if spec is None:
            spec = FALLBACK_GPU_HARDWARE
            if env.rank == 0:
                warnings.warn(f"no hardware file describes the {name}: parallel.strategy=auto plans it as "
                              f"{spec} (planner/hardware/{spec}.yaml); --plan --hardware FILE describes another GPU",
                              stacklevel=2)
        return load_hardware(spec, precision)
    return load_hardware("local", precision)


def budget(cfg: Config, env: DistEnv) -> tuple[int | None, int]:
    """(device memory, runtime reserve): parallel.device_memory, else the GPU's; CPU: no limit."""
    if cfg.parallel.device_memory:
        memory = parse_bytes(cfg.parallel.device_memory, "parallel.device_memory")
    elif env.device.type == "cuda":
        memory = torch.cuda.get_device_properties(env.device).total_memory
    else:
        return None, 0
    return memory, default_reserve(memory) if env.device.type == "cuda" else 0


def candidates(cfg: Config, world: int, memory: int | None, reserve: int,
               hardware: Hardware) -> list[tuple[LayoutPlan, Config]]:
    """Every layout that fits, with the config it came from, fastest first. When none fits, the
    same search with each sequence split over c = 2, 4, 8 ranks (context parallelism: the
    activations of s/c tokens per rank), the smallest c that fits, where the world size, the
    block (2c chunks) and the model (dropout 0) allow it."""
    found = _search(cfg, world, memory, reserve, hardware)
    for c in cp_degrees(cfg, world) if cfg.parallel.cp == 1 else ():
        if found:
            break
        split = copy.deepcopy(cfg)
        split.parallel.cp = c
        found = _search(split, world, memory, reserve, hardware)
    return found


def _search(cfg: Config, world: int, memory: int | None, reserve: int,
            hardware: Hardware) -> list[tuple[LayoutPlan, Config]]:
    found: list[tuple[LayoutPlan, Config]] = []
    for ac in (False, True):
        for schedule in SCHEDULES:
            for m in MICROBATCHES:
                variant = copy.deepcopy(cfg)
                p = variant.parallel
                p.activation_checkpointing, p.microbatches = ac, m
                for key, value in schedule.items():
                    setattr(p, key, value)
                result = plan(variant, world, memory, hardware, reserve)
                found += [(lp, variant) for lp in result.layouts if lp.fits is not False
                          and (lp.layout.pp > 1 or (schedule is SCHEDULES[0] and m == 0))]
    found.sort(key=lambda pair: pair[0].time.step_s)
    return found


def resolved_config(lp: LayoutPlan, variant: Config, world: int) -> Config:
    """The config that launches `lp`: its engine, tp, pp, schedule, M and checkpointing."""
    lay = lp.layout
    engine = Engine.DDP if lay.strategy is Engine.NONE else lay.strategy
    choice = DataParallelChoice(engine, lay.reshard_after_forward or engine is not Engine.FSDP, lay.dp_replicate)
    cfg = layout_config(variant, choice, lay.tp, lay.pp)
    cfg.parallel.tp_vocab_parallel = lay.tp_vocab_parallel  # the planner's choice of head under tp
    if lay.pp > 1:
        cfg.parallel.microbatches = lay.microbatches
    cfg.parallel.auto_world_size = world
    check_layout(cfg, world)  # the launch's own checks, as for a layout given by hand
    return cfg


def _choose(cfg: Config, env: DistEnv) -> tuple[dict, list[str]]:
    """Rank 0: the resolved parallel section and the lines the start-up view prints."""
    memory, reserve = budget(cfg, env)
    hardware = hardware_for(env, cfg.trainer.precision)
    found = candidates(cfg, env.world_size, memory, reserve, hardware)
    if not found:
        limit = f"parallel.device_memory {fmt_bytes(memory)}" if memory else "this world size"
        raise UsageError(f"parallel.strategy=auto: no layout fits {limit} on {env.world_size} ranks; "
                         f"python main.py --plan --world-size {env.world_size} shows why")
    lines = []
    for what, (lp, _) in zip(("chose", "runner-up"), found[:2]):
        lines.append(f"auto: {what} {display_name(lp)}{' + activation checkpointing' * lp.layout.activation_checkpointing}"
                     f" (mb {lp.layout.micro_batch_size} x {lp.layout.microbatches}): predicted step "
                     f"{fmt_seconds(lp.time.step_s)}, peak {fmt_bytes(lp.memory.peak)} on {hardware.name}")
    return dataclasses.asdict(resolved_config(*found[0], env.world_size).parallel), lines


def _recorded(cfg: Config, world: int) -> dict | None:
    """The parallel section auto resolved for this world size into this run folder before."""
    path = Path(cfg.trainer.run_dir).expanduser() / "config.yaml"
    if cfg.trainer.resume == "never" or not path.is_file():
        return None
    try:
        section = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("parallel") or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return None
    return section if section.get("auto_world_size") == world else None


def choose_layout(cfg: Config, env: DistEnv) -> tuple[Config, list[str]]:
    """Collective. cfg with the layout auto resolves to on this launch, and the lines saying so."""
    section = _recorded(cfg, env.world_size)
    lines = [f"auto: keeps the layout chosen for {env.world_size} ranks in this run folder (config.yaml)"]
    if section is None:
        message: list = [None]
        if env.rank == 0:
            try:
                message = [_choose(cfg, env)]
            except UsageError as e:
                message = [str(e)]
        if env.distributed:
            dist.broadcast_object_list(message, src=0)
        if isinstance(message[0], str):
            raise UsageError(message[0])
        section, lines = message[0]
    known = {f.name for f in dataclasses.fields(ParallelConfig)}
    resolved = copy.deepcopy(cfg)
    resolved.parallel = ParallelConfig(**{k: v for k, v in section.items() if k in known})
    resolved.parallel.device_memory = cfg.parallel.device_memory
    check_layout(resolved, env.world_size)
    return resolved, lines
