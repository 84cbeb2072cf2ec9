"""ZeRO-1/2's engine: which slice of every tensor a rank owns, the bucketed collectives that
move those slices, and `ZeroDataParallel`, the module wrapper that reduces gradients in backward
(what DDP is to ddp; parallel/zero.py builds stages 1 and 2 on it).

Every parameter is flattened and split with torch.chunk semantics (chunk = ceil(numel / n); rank r
owns [r*chunk, (r+1)*chunk) clipped to the tensor), so each rank's share is 1/n of every tensor to
within one element per tensor. `ShardBucket` groups parameters (backward order,
`parallel.bucket_cap_mb` per bucket) so one collective moves a whole bucket; `ShardPlan` is the
plan of one model: each parameter's slice (a view into the full parameter's storage: the
optimizer updates the weights in place, no extra copy) and its bucket.

Gradients are reduce-scattered bucket by bucket during backward: a post-accumulate-grad hook per
parameter counts the bucket's finished gradients and reduces the bucket when it is complete, so
communication overlaps the rest of backward. Stage 1 keeps the full gradients (4a bytes) and
accumulates micro-batches locally, reducing only in the last micro-batch's backward (the switch
`set_requires_gradient_sync`, FSDP2's name for it); each rank's reduced slice is written into its
region of the full gradient. Stage 2 reduces on every micro-batch and frees the full gradients,
so only the slices (4a/n) survive. Either way a step moves a reduce-scatter and (after the
optimizer) an all-gather: 2K(n-1)/n bytes per rank, DDP's volume.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel.collectives import all_gather_single, reduce_scatter


@dataclass(frozen=True)
class ShardSpec:
    """Rank r's slice of one flattened tensor, torch.chunk style (as DTensor Shard(0) would
    split the flat tensor): chunk = ceil(numel / n), slice [lo, hi) = [r*chunk, (r+1)*chunk)
    clipped to numel, so the last ranks may hold less, or nothing."""
    numel: int
    chunk: int
    lo: int
    hi: int

    @classmethod
    def of(cls, numel: int, n: int, rank: int) -> "ShardSpec":
        chunk = -(-numel // n)
        lo = min(rank * chunk, numel)
        return cls(numel, chunk, lo, min(lo + chunk, numel))

    @property
    def length(self) -> int:
        return self.hi - self.lo


class ShardBucket:
    """Tensors moved by one collective. The flat buffer is rank-major: viewed as (n, total),
    row j holds rank j's slice of every tensor, each padded to its chunk, so a reduce-scatter
    hands rank j exactly row j and all_gather_single rebuilds every row."""

    def __init__(self, params: list[nn.Parameter], specs: list[ShardSpec], n: int, group):
        self.params, self.specs, self.n, self.group = params, specs, n, group
        self.offsets = list(itertools.accumulate([0] + [s.chunk for s in specs]))
        self.total = self.offsets.pop()
        self.ready = 0  # stage 2: parameters of this bucket whose gradient is final
        self.reduced = False

    def reduce_scatter(self, fulls: list[torch.Tensor]) -> list[torch.Tensor]:
        """Mean over the dp ranks of each whole tensor, as this rank's slices (views into one
        buffer of `total` elements)."""
        rows = [F.pad(t.reshape(-1), (0, self.n * s.chunk - s.numel)).view(self.n, s.chunk)
                for t, s in zip(fulls, self.specs)]
        packed = torch.cat(rows, dim=1)  # (n, total)
        if self.n == 1:
            out = packed.view(-1)
        else:
            out = packed.new_empty(self.total)
            reduce_scatter(out, packed.view(-1), self.group)  # a sum: gloo has no AVG
            out.div_(self.n)
        return [out[o:o + s.length] for o, s in zip(self.offsets, self.specs)]

    def all_gather(self, slices: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whole flat tensors (numel elements each) from every rank's slices."""
        mine = torch.cat([F.pad(t.reshape(-1), (0, s.chunk - s.length)) for t, s in zip(slices, self.specs)])
        if self.n == 1:
            out = mine
        else:
            out = mine.new_empty(self.n * self.total)
            all_gather_single(out, mine, group=self.group)
        rows = out.view(self.n, self.total)
        return [rows[:, o:o + s.chunk].reshape(-1)[:s.numel] for o, s in zip(self.offsets, self.specs)]


class ShardPlan:
    """This rank's slice of every parameter of `parts` and the buckets that move them, for the
    optimizer param `groups` (Strategy.param_groups) on n ranks."""

    def __init__(self, parts: list[nn.Module], groups: list[dict], n: int, rank: int, bucket_cap_mb: float,
                 group):
        self.n, self.group = n, group
        self.fqn = {p: name for part in parts for name, p in part.named_parameters()}
        self.spec: dict[nn.Parameter, ShardSpec] = {}
        self.shard: dict[nn.Parameter, nn.Parameter] = {}  # full parameter -> its slice (a view)
        self.full_of: dict[nn.Parameter, nn.Parameter] = {}
        self.groups = []  # `groups` with each parameter replaced by its slice
        for g in groups:
            slices = []
            for p in g["params"]:
                spec = ShardSpec.of(p.numel(), n, rank)
                # A leaf Parameter sharing p's storage: the optimizer updates p in place.
                s = nn.Parameter(p.detach().view(-1)[spec.lo:spec.hi])
                self.spec[p], self.shard[p], self.full_of[s] = spec, s, p
                slices.append(s)
            self.groups.append({**g, "params": slices})
        # Buckets in reverse registration order (roughly the order backward finishes them).
        cap = bucket_cap_mb * 2**20
        self.buckets: list[ShardBucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed([p for g in groups for p in g["params"]]):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(ShardBucket(current, [self.spec[q] for q in current], n, group))
                current, size = [], 0
        if current:
            self.buckets.append(ShardBucket(current, [self.spec[q] for q in current], n, group))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}

    def gather_full(self, local: Callable[[nn.Parameter], torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """Collective: whole tensors (shaped like the parameter) from each rank's slice local(p)."""
        out = {}
        for b in self.buckets:
            for p, full in zip(b.params, b.all_gather([local(p) for p in b.params])):
                out[p] = full.view(p.shape)
        return out

    @torch.no_grad()
    def gather_params(self) -> None:
        """Collective: every rank's updated slices -> every rank's full parameters."""
        for b in self.buckets:
            for p, full in zip(b.params, b.all_gather([self.shard[p] for p in b.params])):
                p.view(-1).copy_(full)


class ZeroDataParallel(nn.Module):
    """`module` with ZeRO-1/2's gradient reduction (module doc). `keep_full_grads`: stage 1."""

    def __init__(self, module: nn.Module, plan: ShardPlan, keep_full_grads: bool):
        super().__init__()
        self.module, self.plan, self.keep_full_grads = module, plan, keep_full_grads
        self.sync = True
        self._end_queued = False
        for p in plan.shard:  # unique: a tied matrix gets one hook
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False: the next backward only accumulates (stage 1; stage 2 always reduces)."""
        self.sync = sync

    @property
    def reducing(self) -> bool:
        return self.sync or not self.keep_full_grads

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._end_queued:  # at the end of backward: buckets with unused parameters, reset
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self.plan.bucket_of[p]
        bucket.ready += 1
        if self.reducing and bucket.ready == len(bucket.params):
            self._reduce(bucket)

    @torch.no_grad()
    def _reduce(self, bucket: ShardBucket) -> None:
        fulls = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        for p, full, part in zip(bucket.params, fulls, bucket.reduce_scatter(fulls)):
            s, spec = self.plan.shard[p], self.plan.spec[p]
            if self.keep_full_grads:  # stage 1: the mean slice, in place in the full gradient
                p.grad = full
                s.grad = full.view(-1)[spec.lo:spec.hi].copy_(part)
            else:  # stage 2: slices add up over micro-batches; the full gradient goes
                s.grad = part if s.grad is None else s.grad.add_(part)
                p.grad = None
        bucket.reduced = True

    def _end_of_backward(self) -> None:
        for b in self.plan.buckets:  # the same buckets on every rank, so every rank reduces them
            if self.reducing and not b.reduced:
                self._reduce(b)
            b.ready, b.reduced = 0, False
        self._end_queued = False
