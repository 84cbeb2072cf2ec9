"""fp16 loss scaling for every layout: `make_grad_scaler` and `DistributedGradScaler`.

fp16 needs loss scaling (its 5-bit exponent underflows small gradients); bf16 and fp32 do not.
torch's GradScaler decides per rank whether a step had inf/nan gradients. When each rank holds
only some of the gradients (dp shards under ZeRO/FSDP, tp shards, pp stages) the ranks could
disagree and one would skip a step the others take, so the verdict is all-reduced over the ranks
that split the gradients: the dp group for sharded data parallelism, the whole world when tp or
pp split them too.

torch's ShardedGradScaler all-reduces that verdict over a process group, but its unscale kernel
takes plain tensors only, and tensor-parallel and FSDP2 gradients are DTensors (mixed with plain
ones for replicated parameters). `DistributedGradScaler` hands it each gradient's local tensor:
unscaling is elementwise, so scaling the local shard in place is scaling the DTensor, and a
non-finite value anywhere is seen by the rank that holds it.

It also gives the inf/nan verdict the shape torch's own GradScaler gives it, [] instead of
ShardedGradScaler's [1]: GradScaler.step hands that tensor to fused optimizers, and fused AdamW
refuses a [1]-shaped one (workaround of 2026-11, torch 2.13, pytorch#140514).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from config import Config
from parallel.dtensor import local_tensor
from parallel.layout import Layout


def make_grad_scaler(cfg: Config, layout: Layout, mesh: DeviceMesh | None, device: torch.device,
                     grads_sharded_over_dp: bool) -> torch.amp.GradScaler | None:
    """The grad scaler of this layout: None without fp16; a plain GradScaler when every rank
    holds every gradient it steps; else one whose inf/nan verdict is agreed (module doc)."""
    if cfg.trainer.precision != "fp16" and cfg.parallel.mixed_precision != "fp16":
        return None
    if layout.tp_enabled or layout.pp_enabled:
        group = dist.group.WORLD
    elif grads_sharded_over_dp and layout.grad_ranks > 1:  # FSDP2 shards over dp (x cp under cp)
        group = mesh[layout.grad_dim].get_group()
    else:
        return torch.amp.GradScaler(device.type)
    scaler = DistributedGradScaler(device.type, process_group=group)
    # The scale is created lazily by scale(); pipeline ranks without the loss never call it, so
    # create it now on every rank.
    scaler.scale(torch.zeros((), device=device))
    return scaler


class _LocalGrad:
    """What _unscale_grads_ reads of a parameter: its gradient (here the local tensor)."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad


class _LocalGradView:
    """Optimizer look-alike whose param_groups hold the local tensors of the real gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.param_groups = [
            {"params": [_LocalGrad(local_tensor(p.grad)) for p in group["params"] if p.grad is not None]}
            for group in optimizer.param_groups]


class DistributedGradScaler(ShardedGradScaler):
    """ShardedGradScaler (inf/nan verdict all-reduced over `process_group`) for DTensor and
    plain gradients alike."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        # A [] view of the same one-element tensor: the unscale kernel and the all-reduce in
        # ShardedGradScaler.unscale_ write it in place; fused AdamW reads it as a scalar.
        return super()._unscale_grads_(_LocalGradView(optimizer), inv_scale, found_inf.view(()), allow_fp16)
