"""fp16 loss scaling when gradients are split over ranks (tensor- and pipeline-parallel layouts).

Owns `DistributedGradScaler`. torch's GradScaler decides per rank whether a step had inf/nan
gradients; when each rank holds only some of the gradients (tp shards, pp stages) the ranks could
disagree and one would skip a step the others take. torch's ShardedGradScaler all-reduces that
verdict over a process group, but its unscale kernel takes plain tensors only, and tensor-parallel
gradients are DTensors (mixed with plain ones for replicated parameters). This subclass hands it
each gradient's local tensor: unscaling is elementwise, so scaling the local shard in place is
scaling the DTensor, and a non-finite value anywhere is seen by the rank that holds it.

It also gives the inf/nan verdict the shape torch's own GradScaler gives it, [] instead of
ShardedGradScaler's [1]: GradScaler.step hands that tensor to fused optimizers, and fused AdamW
(plain parameters, e.g. a pipeline stage without data parallelism) refuses a [1]-shaped one
(workaround of 2026-11, torch 2.13, pytorch#140514).
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class _LocalGrad:
    """What _unscale_grads_ reads of a parameter: its gradient (here the local tensor)."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad


class _LocalGradView:
    """Optimizer look-alike whose param_groups hold the local tensors of the real gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.param_groups = [
            {"params": [_LocalGrad(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                        for p in group["params"] if p.grad is not None]}
            for group in optimizer.param_groups]


class DistributedGradScaler(ShardedGradScaler):
    """ShardedGradScaler (inf/nan verdict all-reduced over `process_group`) for DTensor and
    plain gradients alike."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        # A [] view of the same one-element tensor: the unscale kernel and the all-reduce in
        # ShardedGradScaler.unscale_ write it in place; fused AdamW reads it as a scalar.
        return super()._unscale_grads_(_LocalGradView(optimizer), inv_scale, found_inf.view(()), allow_fp16)
