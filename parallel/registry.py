"""The strategy registry: `Engine` (parallel/options.py) -> Strategy class, and `build_strategy`,
the one place a launch turns its config into a layout, a mesh and a strategy."""
from __future__ import annotations

from config import Config
from parallel.ddp import DDPStrategy
from parallel.dp import DataParallelStrategy
from parallel.env import DistEnv
from parallel.fsdp import FSDPStrategy
from parallel.layout import Layout
from parallel.options import Engine
from parallel.strategy import Strategy
from parallel.zero import Zero1Strategy, Zero2Strategy, Zero3Strategy

STRATEGIES: dict[Engine, type[Strategy]] = {
    Engine.NONE: Strategy, Engine.DP: DataParallelStrategy, Engine.DDP: DDPStrategy, Engine.FSDP: FSDPStrategy,
    Engine.ZERO1: Zero1Strategy, Engine.ZERO2: Zero2Strategy, Engine.ZERO3: Zero3Strategy,
}


def build_strategy(cfg: Config, env: DistEnv) -> Strategy:
    """Collective under torchrun (the mesh). The checked layout of this launch, its device mesh,
    and the strategy on them; a UsageError before any collective when the layout does not fit."""
    layout = Layout.of(cfg, env.world_size)
    mesh = layout.build_mesh(env.device.type, env.distributed)
    return STRATEGIES[Engine.of(cfg.parallel)](cfg, env, layout, mesh)
