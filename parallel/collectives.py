"""Reduce-scatter with the bytes a ring moves, on every backend.

A reduce-scatter of K bytes over n ranks (each rank ends with the sum of its 1/n) moves K(n-1)/n
bytes per rank on a ring, half an all-reduce (which is a reduce-scatter + an all-gather:
2K(n-1)/n). NCCL's does. gloo's `reduce_scatter_tensor` moves as many bytes as an all-reduce
(measured on loopback at n=2: 2.00x the payload, where a ring moves 1.00x; torch 2.13), so every
reduce-scatter-based strategy on CPU would pay all-reduce volume. On gloo `reduce_scatter` is
therefore an all-to-all of the n chunks followed by a local sum: each rank sends the n-1 chunks
other ranks own and receives theirs of its own chunk, K(n-1)/n bytes, a ring's volume.

`RingReduceScatter` plugs the same into FSDP2 (`FSDPModule.set_custom_reduce_scatter`), so
ZeRO-3/fsdp on gloo move what theory says too. benchmarks/bytes_per_strategy.py measures it.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor to these (the old names warn);
# earlier builds, such as the CUDA 2.11 wheel scripts/gpu_check.sh is run with, have only the old
# ones (https://github.com/pytorch/pytorch/pull/186123).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """output (K/n elements) = the sum (or mean, op AVG) over the ranks of `group` of rank r's
    chunk r of input (K elements, rank-major). Synchronous."""
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"reduce_scatter supports SUM and AVG, not {op}")
    n = dist.get_world_size(group)
    if dist.get_backend(group) != "gloo":
        reduce_scatter_single(output, input, op=op, group=group)
        return
    received = torch.empty_like(input)
    dist.all_to_all_single(received, input, group=group)  # row j: rank j's copy of my chunk
    torch.sum(received.view(n, -1), dim=0, out=output.view(-1))
    if op == dist.ReduceOp.AVG:
        output.div_(n)


class RingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter hook (`set_custom_reduce_scatter`) running `reduce_scatter`."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        reduce_scatter(output_tensor, input_tensor, group, op)
        return None
