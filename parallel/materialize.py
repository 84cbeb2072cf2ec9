"""From a model on the meta device to this rank's share of it, filled: no rank holds the whole model.

`parallelize` places a GPT built on the meta device (shapes, no storage): the pipeline split, tensor
parallelism and the sharding engines (FSDP2, HSDP, zero-3) all run on meta tensors. `materialize`
then allocates only what this rank keeps, on its device (`nn.Module.to_empty`), and fills every
parameter with its slice of the initial value: one tensor at a time, so the peak is this rank's
share plus the largest single parameter, whatever the model's size.

The initial value of a parameter comes from `initial(part, name)`: model.initial_tensor (each
parameter from a generator seeded with (trainer.seed, name), so every layout starts from the same
weights as one process, bit for bit), or a weights file's tensor (model.init_from). A DTensor (tp,
FSDP2) keeps the slice its placements give it on its mesh (DTensor's own shard arithmetic, so
uneven shards come out as FSDP2 and tensor parallelism lay them out).

Engines that hold a whole replica by design (DDP, ZeRO-1/2, nn.DataParallel) are wrapped after
their replica is materialised: DDP wrapped on meta and then materialised stops all-reducing
gradients (each rank keeps its own), and ZeRO-1/2's shard plan keeps views of the storage it saw
at wrap time (both measured).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

# (module, parameter name) -> the parameter's whole initial value
InitialValue = Callable[[nn.Module, str], torch.Tensor]


def on_meta(parts: list[nn.Module]) -> bool:
    """Were these modules built on the meta device (nothing allocated yet)?"""
    return any(p.is_meta for part in parts for p in part.parameters())


@torch.no_grad()
def materialize(parts: list[nn.Module], device: torch.device, initial: InitialValue) -> None:
    """Allocate `parts` (this rank's pipeline stages, possibly tensor-parallel or FSDP2-sharded) on
    `device` and fill each parameter with its slice of `initial`. A tensor shared by two names (tied
    embeddings) is filled once."""
    for part in parts:
        tied = _shared_parameters(part)
        part.to_empty(device=device)
        for places in tied:  # to_empty allocates each module's attribute apart: tie them again
            first = getattr(*places[0])
            for module, attr in places[1:]:
                setattr(module, attr, first)
    for part in parts:
        for name, p in part.named_parameters():
            copy_slice(p, initial(part, name))


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of every parameter held in more than one place (tied weights)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for attr, p in sub.named_parameters(recurse=False):
            places.setdefault(id(p), []).append((sub, attr))
    return [where for where in places.values() if len(where) > 1]


def copy_slice(p: torch.Tensor, whole: torch.Tensor) -> None:
    """p (a plain tensor, or a DTensor's local shard) = its slice of the parameter's whole value."""
    if isinstance(p, DTensor):
        local = p.to_local()
        if local.numel():
            local.copy_(local_piece(whole, p.device_mesh, p.placements))
        return
    p.copy_(whole)


def local_piece(whole: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's piece of `whole`, cut the way the engines cut it: the last mesh dimension first
    (tensor parallel splits the whole tensor), then each earlier one on what the later ones left
    (FSDP2 chunks the tp-local tensor: a `_StridedShard`), each a torch.chunk of its dimension, the
    last ranks of an uneven split getting an empty piece. It needs only the mesh's coordinates, so
    it runs the same on the dry run's fake tensors: there DTensor's offset arithmetic
    (`compute_local_shape_and_global_offset`, which reads index tensors' values and so ran outside
    the fake mode) gave 7 rows where FSDP2 holds 6 when a tp-local dim 0 does not split evenly
    over dp (65 vocabulary rows over tp 2 x dp 4), and the dry run failed (found by its sweep; a
    real launch of that layout starts from one process's weights bit for bit either way,
    tests/test_initial_weights.py)."""
    piece, coordinate = whole, mesh.get_coordinate()
    for i in reversed(range(mesh.ndim)):
        placement = placements[i]
        # FSDP2 marks its dim-0 split of a tp-sharded tensor `_StridedShard`, which in torch 2.13
        # is not a Shard (is_shard() is False): both cut a dimension
        if placement.is_shard() or isinstance(placement, _StridedShard):
            chunks = torch.chunk(piece, mesh.size(i), dim=placement.dim)
            piece = chunks[coordinate[i]] if coordinate[i] < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece
