"""parallel.strategy=ddp: torch's DistributedDataParallel over the mesh's `dp` dimension.

Every rank holds the full model, gradients and optimizer state (fp32 Adam: 4a + 4a + 8a = 16a
bytes for a parameters, plus DDP's gradient buckets: 4a more unless `gradient_as_bucket_view`
makes the gradients views into the buckets). Backward hooks all-reduce gradients bucket by bucket
(`bucket_cap_mb`, in reverse parameter order, overlapping with the rest of backward); a ring
all-reduce moves 2K(N-1)/N bytes per rank for K bytes of gradients.

Gradient accumulation: all micro-batches but the last run under `no_sync()`, so gradients
accumulate locally and are all-reduced once per optimizer step.

With a single process (plain `python main.py`) there is nothing to synchronise: the model is
left unwrapped, which is exactly what DDP with world size 1 would compute.
"""
from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from config import UsageError
from parallel import Strategy


class DDPStrategy(Strategy):
    name = "ddp"
    takes_tensor_parallel_params = False  # DDP broadcasts/reduces plain tensors only (measured)

    def describe_dp(self) -> str:
        p = self.cfg.parallel
        if self.dp_size == 1:
            return "ddp (one data-parallel rank: no gradient all-reduce)"
        return (f"ddp (bucket {p.bucket_cap_mb:g} MB, grads as bucket views "
                f"{'on' if p.gradient_as_bucket_view else 'off'}"
                f"{', static graph' if p.static_graph else ''})")

    def validate_layout(self) -> None:
        super().validate_layout()
        if self.cfg.parallel.static_graph and self.grad_accum_steps > 1:
            # torch DDP bug (pytorch#143580, fix pending in #187732): static_graph with no_sync()
            # asserts in the reducer on the first backward, and once past that stops reducing.
            raise UsageError(f"parallel.static_graph=true cannot be combined with gradient accumulation "
                             f"({self.grad_accum_steps} micro-batches per step; DDP bug pytorch#143580); "
                             f"set trainer.micro_batch_size=0 or parallel.static_graph=false")

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        if self.dp_size == 1:
            return model
        p = self.cfg.parallel
        self._ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=self.mesh["dp"].get_group(),
            bucket_cap_mb=p.bucket_cap_mb,
            gradient_as_bucket_view=p.gradient_as_bucket_view,
            static_graph=p.static_graph,
        )
        return self._ddp

    def no_sync(self, skip_sync: bool):
        if skip_sync and self.dp_size > 1:
            return self._ddp.no_sync()
        return contextlib.nullcontext()
