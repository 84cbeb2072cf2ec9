"""DTensor helpers: the one place that asks whether a tensor is distributed (and `storage_id`, the
identity that byte counters de-duplicate storages by).

Tensor parallelism (DTensor `parallelize_module`) and FSDP2 (`fully_shard`) turn parameters and
gradients into DTensors; pipeline stages, DDP and ZeRO-1/2 keep plain tensors; a tp layout mixes
both (LayerNorms and a replicated embedding stay plain). Code that must work on either calls these.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` stored on this rank (a DTensor's shard or replica; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def storage_id(t: torch.Tensor) -> int:
    """Identity of the storage under `t` (views of one storage share it). Not its address: a fake
    tensor's (FakeTensorMode, the dry run) is 0 for every storage; the StorageImpl is distinct."""
    return t.untyped_storage()._cdata


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Collective for a sharded DTensor: the whole tensor on every rank of its mesh."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def same_layout_groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split into plain tensors and DTensors per (mesh, placements) (of a parameter: of its
    gradient): foreach kernels take neither a DTensor/plain mix nor mixed meshes."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        g = t.grad if isinstance(t, nn.Parameter) and t.grad is not None else t
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else ()
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def grad_like_param(p: nn.Parameter) -> torch.Tensor:
    """p.grad laid out like p. A DTensor gradient may come back in another placement than its
    parameter (a vocabulary-parallel embedding's gradient is Replicate while the weight is
    Shard(0)); code that adds two gradients element by element needs them alike."""
    g = p.grad
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g


def settle_partial_grads(modules: list[nn.Module]) -> None:
    """Collective (tp). Every gradient left Partial, reduced once to its parameter's placement:
    under sequence parallelism a LayerNorm weight's gradient is a Partial sum (each tp rank saw
    T / tp positions), and left so, every later read of it (the gradient norm, AdamW's three)
    would all-reduce it again (measured by benchmarks/strategy_report.py). The Partial sums of
    replicated parameters on a 1-D mesh (every LayerNorm's) go in one all-reduce per mesh and
    dtype: one call each would pay the link's latency 2 x (num LayerNorms) times per step."""
    params = [p for p in {id(p): p for m in modules for p in m.parameters()}.values()
              if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)]
    batches: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if g.device_mesh.ndim == 1 and g.placements == (Partial("sum"),) and p.placements == (Replicate(),):
            batches.setdefault((id(g.device_mesh), g.dtype), []).append(p)
        else:
            grad_like_param(p)
    for batch in batches.values():
        mesh = batch[0].grad.device_mesh
        locals_ = [p.grad.to_local() for p in batch]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, piece in zip(batch, flat.split([t.numel() for t in locals_])):
            p.grad = DTensor.from_local(piece.view(p.grad.shape), mesh, (Replicate(),), run_check=False)
