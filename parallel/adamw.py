"""AdamW with torch's fused kernel on every layout: `MeshwiseAdamW`.

torch's fused AdamW takes one list of parameters of one kind: all plain tensors, or all DTensors on
one mesh. Tensor parallelism mixes them (its Linear weights are DTensors on the tp mesh, the
LayerNorms and a replicated embedding stay plain; fsdp x tp puts shards on two meshes), so AdamW
with fused=True refuses such a model and torch's default for it on a CPU is a loop over the
parameters, about ten ops each, every one a DTensor dispatch on the sharded ones: 21.1 ms a step
for a tp2 rank of 8 blocks of 256, where the fused kernel over the same elements took 2.8
(docs/planner.md).

`MeshwiseAdamW` is that same optimizer (one `param_groups`, one `state`, AdamW's state dict, so
snapshots, DCP and the LR scheduler see no difference) whose step calls the fused kernel once per
kind of parameter in each group (parallel/dtensor.same_layout_groups: plain tensors, or DTensors
of one mesh and placements). The arithmetic is AdamW's, element by element.
"""
from __future__ import annotations

import torch
from torch.optim.adam import adam

from parallel.dtensor import grad_like_param, same_layout_groups


class MeshwiseAdamW(torch.optim.AdamW):
    """torch.optim.AdamW(fused=True) for parameters of several kinds (module doc)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs, fused=True)

    @torch.no_grad()
    def step(self, closure=None):
        self._accelerator_graph_capture_health_check()  # as torch's Adam.step (capturable under CUDA graphs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                grad_like_param(p)  # the kernel steps a gradient laid out like its parameter
            for kind in same_layout_groups(params):
                self._step_fused(group, kind)
        return loss

    def _step_fused(self, group: dict, kind: list[torch.Tensor]) -> None:
        """AdamW's step (Adam.step) on one kind of parameter of `group`, in one fused call."""
        lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
        has_complex = self._init_group(dict(group, params=kind), *lists)
        beta1, beta2 = group["betas"]
        adam(*lists, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"], foreach=False,
             capturable=group["capturable"], differentiable=False, fused=True,
             grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
             decoupled_weight_decay=True)
