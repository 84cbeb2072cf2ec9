"""`parallelize`: place a GPT onto this rank's share of a layout, in the one order that composes.

    1. pipeline split   mesh["pp"]  this rank keeps its stages (parallel/pp.py split_stages)
    2. tensor parallel  mesh["tp"]  Megatron column/row split of every block (parallel/tp.py)
    3. activation checkpointing     every block recomputes its activations in backward
    4. compile                      torch.compile of each block, in place
    5. data parallel    mesh["dp"]  the strategy's engine: DDP, FSDP2, ZeRO, nn.DataParallel

Why this order: each step works on what the one before produced. The pipeline split copies whole
blocks, so it comes before anything replaces parameters with DTensors; FSDP2 shards the tp
DTensors once more over dp (its documented 2-D composition), so tp comes before dp. Compile
takes each block, as torchtitan does, before the data-parallel engine: the engine's hooks (FSDP2's
all-gathers and reduce-scatters, DDP's buckets) stay outside the compiled graphs, so they run as
in eager mode and no graph breaks at them; every block has the same code, so one compilation
serves all; and the embeddings and the loss stay eager: inductor's embedding backward adds with
atomics, whose order (and so the low bits of the sum) differs between runs and between tp peers
that must hold the same replicated gradient. The result is the StepRunner this rank trains with: a
micro-batch loop over the whole model, or the pipeline schedule over its stages (parallel/step.py).
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from config import Config
from model import GPT
from parallel.env import DistEnv
from parallel.layout import Layout
from parallel.pp import Pipeline, split_stages
from parallel.step import MicroBatchLoop, StepRunner
from parallel.tp import apply_tensor_parallel


def parallelize(model: GPT, cfg: Config, layout: Layout, mesh: DeviceMesh | None, env: DistEnv,
                wrap_data_parallel: Callable[[nn.Module], nn.Module]) -> StepRunner:
    """`model` is built identically on every rank (same seed or the same weights file);
    `wrap_data_parallel` is the strategy's step 4. Returns this rank's StepRunner."""
    p = cfg.parallel
    if any(t.device != env.device for t in model.parameters()):  # fake tensors cannot move (a dry run's)
        model.to(env.device)
    # 1. pipeline split: this rank's stages by stage id (the whole model is stage 0 without pp)
    stages = split_stages(model, layout, layout.coordinate(env.rank).pp) if layout.pp_enabled else {0: model}
    # 2. tensor parallel, per stage
    if layout.tp_enabled:
        for part in stages.values():
            apply_tensor_parallel(part, mesh["tp"], p.tp_vocab_parallel, p.sequence_parallel)
    # 3. activation checkpointing
    for part in stages.values():
        for block in part.blocks.values():
            block.activation_checkpointing = p.activation_checkpointing
    # 4. compile: each block in place (the stage the schedule runs stays the DDP/FSDP module)
    if cfg.trainer.compile:
        for part in stages.values():
            for block in part.blocks.values():
                block.compile()
    # 5. data parallel, per stage
    wrapped = [wrap_data_parallel(part) for part in stages.values()]
    if not layout.pp_enabled:
        return MicroBatchLoop(model, wrapped[0], cfg, env.device, layout.microbatches)
    return Pipeline(stages, wrapped, cfg, layout, mesh, env.device, env.rank)
