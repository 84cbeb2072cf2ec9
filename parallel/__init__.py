"""Parallel layouts of a GPT: what `parallel.*` in the config selects, behind one interface.

    config ──> Layout.of(cfg, world)      parallel/layout.py    degrees pp x dp x tp, every world-size check
           ──> build_strategy(cfg, env)   here                  the mesh + the data-parallel strategy
           ──> strategy.setup(model)      parallel/parallelize.py  pp split -> tp -> checkpointing -> dp -> compile
           ──> Trainer                    trainer.py            calls only Strategy methods

`parallel.strategy` (+ `zero_stage`) picks the Strategy class, the engine of the data-parallel
dimension; tensor and pipeline parallelism compose with it inside `parallelize`. Where each
part lives:

    strategy.py    Strategy: the interface and `none`      ddp.py     DDP
    zero.py        ZeRO-1/2 (element sharding), ZeRO-3     fsdp.py    FSDP2 fully_shard
    zero_shard.py  ZeRO-1/2's slices and bucketed collectives
    dp.py          nn.DataParallel (one process, all GPUs)
    tp.py          Megatron tensor parallelism (DTensor parallelize_module)
    pp.py          pipeline stages and schedule (torch.distributed.pipelining): a StepRunner
    step.py        StepRunner and the micro-batch loop     scaler.py  fp16 grad scalers
    dtensor.py     DTensor helpers                         env.py     process group start-up
"""
from __future__ import annotations

from config import Config, ParallelConfig
from parallel.ddp import DDPStrategy
from parallel.dp import DataParallelStrategy
from parallel.env import DistEnv
from parallel.fsdp import FSDPStrategy
from parallel.layout import Layout
from parallel.strategy import Strategy
from parallel.zero import Zero1Strategy, Zero2Strategy, Zero3Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    "none": Strategy, "dp": DataParallelStrategy, "ddp": DDPStrategy, "fsdp": FSDPStrategy,
    "zero-1": Zero1Strategy, "zero-2": Zero2Strategy, "zero-3": Zero3Strategy,
}


def strategy_class(p: ParallelConfig) -> type[Strategy]:
    """parallel.strategy (and parallel.zero_stage) -> class (config.validate checked the names)."""
    return STRATEGIES[f"zero-{p.zero_stage}" if p.strategy == "zero" else p.strategy]


def build_strategy(cfg: Config, env: DistEnv) -> Strategy:
    """Collective under torchrun (the mesh). The checked layout of this launch, its device mesh,
    and the strategy on them; a UsageError before any collective when the layout does not fit."""
    layout = Layout.of(cfg, env.world_size)
    mesh = layout.build_mesh(env.device.type, env.distributed)
    return strategy_class(cfg.parallel)(cfg, env, layout, mesh)


__all__ = ["Layout", "Strategy", "STRATEGIES", "build_strategy", "strategy_class"]
