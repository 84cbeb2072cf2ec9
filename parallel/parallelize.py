"""`parallelize`: place a GPT onto this rank's share of a layout, in the one order that composes.

    1. pipeline split   mesh["pp"]  this rank keeps its stages (parallel/pp.py split_stages)
    2. tensor parallel  mesh["tp"]  Megatron column/row split of every block (parallel/tp.py)
       context parallel mesh["cp"]  every block's attention over the cp ranks' ring (parallel/cp.py)
    3. activation checkpointing     every block recomputes its activations in backward
    4. compile                      torch.compile of each block, in place (or of the whole model, one process)
    5. data parallel    mesh["dp"]  the strategy's engine: DDP, FSDP2, ZeRO, nn.DataParallel
       (and the weights: the model is built on the meta device; parallel/materialize.py allocates
       this rank's share and fills it, after FSDP2 shards it or before another engine wraps it)

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

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from config import Config
from model import GPT
from parallel.cp import ContextParallelLoop, Ring, apply_context_parallel
from parallel.env import DistEnv
from parallel.layout import Layout
from parallel.materialize import InitialValue, materialize, on_meta
from parallel.options import Engine
from parallel.pp import Pipeline, split_stages
from parallel.step import MicroBatchLoop, StepRunner
from parallel.tp import apply_tensor_parallel


def parallelize(model: GPT, cfg: Config, layout: Layout, mesh: DeviceMesh | None, env: DistEnv,
                wrap_data_parallel: Callable[[nn.Module], nn.Module], initial: InitialValue | None = None,
                shards_parameters: bool = False, init_device: torch.device | None = None) -> StepRunner:
    """`model`: a GPT on the meta device, filled here with `initial` (parallel/materialize.py) after
    the engine shards it (`shards_parameters`: FSDP2) or before it wraps a whole replica (the other
    engines), on `init_device` (the rank's device; the CPU for FSDP2's CPU offload); or a GPT already
    built with its weights (a dry run's fake tensors, a test's model), moved to the device.
    `wrap_data_parallel` is the strategy's step 5. Returns this rank's StepRunner."""
    p = cfg.parallel
    deferred = on_meta([model])
    if deferred and initial is None:
        raise ValueError("a model on the meta device needs its initial values (initial=)")
    if not deferred and any(t.device != env.device for t in model.parameters()):  # one already there stays as it is
        model.to(env.device)
    # 1. pipeline split: this rank's stages by stage id (the whole model is stage 0 without pp)
    stages = split_stages(model, layout, layout.coordinate(env.rank).pp) if layout.pp_enabled else {0: model}
    # 2. tensor parallel, per stage
    if layout.tp_enabled:
        for part in stages.values():
            apply_tensor_parallel(part, mesh["tp"], p.tp_vocab_parallel, p.sequence_parallel)
    if layout.cp_enabled:
        for part in stages.values():
            apply_context_parallel(part, Ring(mesh["cp"].get_group()), p.cp_mode)
    # 3. activation checkpointing (and the attention kernel each block computes with)
    for part in stages.values():
        for block in part.blocks.values():
            block.activation_checkpointing = p.activation_checkpointing
            block.attn.kernel = cfg.trainer.attention
    # 4. compile: each block in place (the stage the schedule runs stays the DDP/FSDP module), or
    # with compile_scope=model (one process, no engine: parallel/options.py) the whole model in
    # place, its embeddings eager (GPT.embed): one graph over the blocks, final LayerNorm and head
    # saves each block's compiled-call overhead (nanoGPT's CPU model: benchmarks/fast_preset_variants.py)
    if cfg.trainer.compile:
        for part in stages.values():
            if cfg.trainer.compile_scope == "model":
                # the embeddings stay eager (as in per-block compile, for the reason above): the graph
                # starts after them, one graph break at the model's first line
                part.embed = torch.compiler.disable(part.embed)
                part.compile()
            else:
                for block in part.blocks.values():
                    block.compile()
    # 5. data parallel, per stage: a sharding engine wraps the meta model and only this rank's
    # shards are allocated; an engine that holds a whole replica wraps it allocated
    parts, device = list(stages.values()), init_device or env.device
    if deferred and not shards_parameters:
        materialize(parts, device, initial)
    wrapped = [wrap_data_parallel(part) for part in parts]
    if deferred and shards_parameters:
        materialize(parts, device, initial)
    # without an engine on dp x cp, the runner averages the gradients over cp
    reduce_over_cp = layout.cp_enabled and Engine.of(p) is Engine.NONE
    if layout.pp_enabled:
        return Pipeline(stages, wrapped, cfg, layout, mesh, env.device, env.rank, reduce_over_cp)
    if layout.cp_enabled:
        return ContextParallelLoop(model, wrapped[0], cfg, env.device, layout.microbatches, mesh["cp"],
                                   reduce_grads=reduce_over_cp)
    return MicroBatchLoop(model, wrapped[0], cfg, env.device, layout.microbatches)
