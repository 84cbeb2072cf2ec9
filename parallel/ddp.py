"""parallel.strategy=ddp: torch's DistributedDataParallel over the mesh's `dp` dimension.

Every rank holds the full model, gradients and optimizer state (fp32 Adam: 4a + 4a + 8a = 16a
bytes for a parameters, plus DDP's gradient buckets: 4a more unless `gradient_as_bucket_view`
makes the gradients views into the buckets). Backward hooks all-reduce gradients bucket by bucket
(`bucket_cap_mb`, in reverse parameter order, overlapping with the rest of backward); a ring
all-reduce moves 2K(N-1)/N bytes per rank for K bytes of gradients.

Gradient accumulation: all micro-batches but the last run under `no_sync()` (parallel/step.py
`gradient_sync`), so gradients accumulate locally and are all-reduced once per optimizer step.
DDP takes plain tensors only: with tp > 1 and dp > 1 the layout check refuses it (use fsdp). A
DDP bug (pytorch#143580) makes static_graph and gradient accumulation exclusive: refused there too.

With a single process (plain `python main.py`) there is nothing to synchronise: the model is
left unwrapped, which is exactly what DDP with world size 1 would compute.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from config import Config
from parallel.env import DistEnv
from parallel.layout import Layout
from parallel.strategy import Strategy


def wrap_ddp(module: nn.Module, cfg: Config, layout: Layout, mesh: DeviceMesh | None, env: DistEnv) -> nn.Module:
    """`module` under DDP on mesh["dp"], or on dp x cp flattened under context parallelism (the
    cp ranks average their gradients too: parallel/cp.py); itself with one rank there. Also
    ZeRO-1's engine."""
    if layout.grad_ranks == 1:
        return module
    p = cfg.parallel
    return DistributedDataParallel(
        module,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        process_group=mesh[layout.grad_dim].get_group(),
        bucket_cap_mb=p.bucket_cap_mb,
        gradient_as_bucket_view=p.gradient_as_bucket_view,
        static_graph=p.static_graph,
    )


class DDPStrategy(Strategy):
    name = "ddp"

    def describe_dp(self) -> str:
        p = self.cfg.parallel
        if self.layout.grad_ranks == 1:
            return "ddp (one data-parallel rank: no gradient all-reduce)"
        return (f"ddp (bucket {p.bucket_cap_mb:g} MB, grads as bucket views "
                f"{'on' if p.gradient_as_bucket_view else 'off'}"
                f"{', static graph' if p.static_graph else ''})")

    def wrap_data_parallel(self, module: nn.Module) -> nn.Module:
        return wrap_ddp(module, self.cfg, self.layout, self.mesh, self.env)

    def params_replicated_over(self) -> str | None:
        return "dp"  # whole copies, stepped alike

    def optimizer_replicated_over(self) -> str | None:
        return "dp"
