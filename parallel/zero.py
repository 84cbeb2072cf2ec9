"""parallel.strategy=zero: ZeRO stages 1, 2 and 3 (`parallel.zero_stage`).

Per-rank bytes for fp32 AdamW with a parameters on n data-parallel ranks (the seed notes'
formulas; measured by tests/test_data_parallel.py and benchmarks/memory_per_strategy.py):

    stage 1  params 4a + grads 4a    + Adam state 8a/n  (optimizer state sharded)
    stage 2  params 4a + grads 4a/n  + Adam state 8a/n  (+ gradients sharded)
    stage 3  params 4a/n + grads 4a/n + Adam state 8a/n (+ parameters sharded) = 16a/n

Stages 1 and 2 shard by ELEMENT, not by tensor: every parameter is flattened and split with
torch.chunk semantics (chunk = ceil(numel / n); rank r owns [r*chunk, (r+1)*chunk) clipped to the
tensor), so each rank's share is 1/n of every tensor to within one element per tensor.
torch's ZeroRedundancyOptimizer assigns WHOLE tensors to ranks (greedy by size), which on a GPT
leaves ranks unbalanced (measured in benchmarks/memory_per_strategy.py), and torch has no engine
for stage 2 at all, so both are built here on reduce_scatter_single / all_gather_single (torch
2.13's names for reduce_scatter_tensor / all_gather_into_tensor, which now warn as deprecated):

- A rank's optimizer works on `shard` tensors that are views into the full parameters' storage
  (no extra copy of the weights). AdamW state exists only for those slices.
- `ShardBucket` groups parameters (backward order, `parallel.bucket_cap_mb` per bucket) so one
  collective moves a whole bucket: its flat buffer is rank-major, row j = rank j's padded slices.
- stage 1: gradients are all-reduced by DDP (buckets, no_sync for accumulation, all DDP options);
  each rank's optimizer steps its slice, then the updated slices are all-gathered into every
  rank's full parameters. Traffic: DDP's all-reduce (2K(n-1)/n) + an all-gather (K(n-1)/n).
- stage 2: no DDP. A post-accumulate-grad hook per parameter reduce-scatters each finished
  bucket during backward and frees the full gradients, so only this rank's averaged slice
  (4a/n) survives. This runs on EVERY micro-batch (slices accumulate): full gradients never pile
  up, at the price of one reduce-scatter per micro-batch (no_sync does not apply).
- clip_grad_norm_ all-reduces the squared norms of the slices (the global norm); fp16 uses
  ShardedGradScaler, whose inf check is all-reduced over the dp group.
- state_dict gathers the full AdamW state into plain tensors keyed by parameter name, exactly
  like DCP's get_state_dict (so a snapshot loads into any strategy and world size); saving thus
  briefly holds 8a of optimizer state per rank. load_state_dict slices it back.
Stages 1 and 2 need plain (non-DTensor) parameters: with parallel.tp or pp > 1 they refuse;
stage 3 composes (it is FSDP2).

stage 3 is FSDP2 (`fully_shard` per block + root, parameters resharded after forward): the same
engine as parallel.strategy=fsdp with its options fixed (dim-0 sharding, padding up to one dim-0
row per tensor).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from config import UsageError
from parallel import Strategy, local_tensor
from parallel.ddp import DDPStrategy
from parallel.fsdp import FSDPStrategy

# Optimizer param-group keys that describe the kernel, not the training state: not loaded from a
# snapshot written by another strategy (which may have used another kernel).
_KERNEL_KEYS = ("params", "fused", "foreach", "capturable", "differentiable")


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
    row j holds rank j's slice of every tensor, each padded to its chunk, so reduce_scatter_single
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
            dist.reduce_scatter_single(out, packed.view(-1), group=self.group)  # gloo has no AVG
            out.div_(self.n)
        return [out[o:o + s.length] for o, s in zip(self.offsets, self.specs)]

    def all_gather(self, slices: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whole flat tensors (numel elements each) from every rank's slices."""
        mine = torch.cat([F.pad(t.reshape(-1), (0, s.chunk - s.length)) for t, s in zip(slices, self.specs)])
        if self.n == 1:
            out = mine
        else:
            out = mine.new_empty(self.n * self.total)
            dist.all_gather_single(out, mine, group=self.group)
        rows = out.view(self.n, self.total)
        return [rows[:, o:o + s.chunk].reshape(-1)[:s.numel] for o, s in zip(self.offsets, self.specs)]


class ZeroStrategy(Strategy):
    """parallel.strategy=zero. Constructing it yields the class of parallel.zero_stage."""

    name = "zero"

    def __new__(cls, cfg, env, mesh=None):
        if cls is ZeroStrategy:
            cls = {1: Zero1Strategy, 2: Zero2Strategy, 3: Zero3Strategy}[cfg.parallel.zero_stage]
        return super().__new__(cls)


class _ElementShardedZero(ZeroStrategy):
    """Stages 1 and 2: replicated parameters, element-sharded AdamW state (see module doc)."""

    stage = 0

    def validate_layout(self) -> None:
        super().validate_layout()
        p = self.cfg.parallel
        if p.tp > 1 or p.pp > 1:
            raise UsageError(f"parallel.zero_stage={p.zero_stage} shards plain tensors and does not compose "
                             f"with parallel.tp/pp > 1; use parallel.zero_stage=3 or parallel.strategy=fsdp")

    @property
    def dp_group(self):
        return self.mesh["dp"].get_group() if self.dp_size > 1 else None

    def describe_dp(self) -> str:
        sharded = "optimizer state" if self.stage == 1 else "optimizer state + gradients"
        return (f"zero-{self.stage} ({sharded} sharded by element over {self.dp_size} ranks, "
                f"bucket {self.cfg.parallel.bucket_cap_mb:g} MB)")

    # ------------------------------------------------------------------ shard plan + optimizer

    def build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over this rank's slices; also fixes the shard plan and the buckets."""
        o = self.cfg.optimizer
        n, rank = self.dp_size, self.dp_rank
        self.fqn = {p: name for part in self.unwrapped() for name, p in part.named_parameters()}
        self.spec: dict[nn.Parameter, ShardSpec] = {}
        self.shard: dict[nn.Parameter, nn.Parameter] = {}  # full parameter -> its slice (a view)
        self.full_of: dict[nn.Parameter, nn.Parameter] = {}
        groups = []
        for group in self.param_groups():
            slices = []
            for p in group["params"]:
                spec = ShardSpec.of(p.numel(), n, rank)
                # A leaf Parameter sharing p's storage: the optimizer updates p in place.
                s = nn.Parameter(p.detach().view(-1)[spec.lo:spec.hi])
                self.spec[p], self.shard[p], self.full_of[s] = spec, s, p
                slices.append(s)
            groups.append({**group, "params": slices})
        # Buckets in reverse registration order (roughly the order backward finishes them).
        cap = self.cfg.parallel.bucket_cap_mb * 2**20
        self.buckets: list[ShardBucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed([p for g in self.param_groups() for p in g["params"]]):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(ShardBucket(current, [self.spec[q] for q in current], n, self.dp_group))
                current, size = [], 0
        if current:
            self.buckets.append(ShardBucket(current, [self.spec[q] for q in current], n, self.dp_group))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        kernel = self._adamw_kernel([s for g in groups for s in g["params"]])
        if self.cfg.trainer.precision == "fp16" and self.dp_size > 1:
            # ShardedGradScaler hands fused AdamW a found_inf of shape [1] where the fused kernel
            # wants [] (RuntimeError in _fused_adam, cf. pytorch#140514): use the default kernel.
            kernel = {}
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), **kernel)
        return self.optimizer

    def gather_params(self) -> None:
        """Every rank's updated slices -> every rank's full parameters."""
        with torch.no_grad():
            for b in self.buckets:
                for p, full in zip(b.params, b.all_gather([self.shard[p] for p in b.params])):
                    p.view(-1).copy_(full)

    def after_optimizer_step(self) -> None:
        self.gather_params()

    # ------------------------------------------------------------------ gradients

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global norm = sqrt(sum over ranks of this rank's slices' squared norms); the slices
        partition every gradient, so nothing is counted twice. Same clip rule as torch's."""
        grads = [s.grad for s in self.shard.values() if s.grad is not None]
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for g in grads:
            sq += g.float().pow(2).sum()
        if self.dp_size > 1:
            dist.all_reduce(sq, group=self.dp_group)
        norm = sq.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return norm

    def make_grad_scaler(self):
        if self.cfg.trainer.precision != "fp16":
            return None
        if self.dp_size == 1:
            return torch.amp.GradScaler(self.device.type)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(self.device.type, process_group=self.dp_group)

    def gather_full(self, local: Callable[[nn.Parameter], torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """Collective: whole tensors (shaped like the parameter) from each rank's slice local(p)."""
        out = {}
        for b in self.buckets:
            for p, full in zip(b.params, b.all_gather([local(p) for p in b.params])):
                out[p] = full.view(p.shape)
        return out

    # ------------------------------------------------------------------ state

    def _ensure_optimizer_state(self) -> None:
        """AdamW creates its state on the first step; a template for loading needs it now. Same
        trick as DCP's get_state_dict: one step with zero gradients and lr 0 (changes nothing)."""
        if self.optimizer.state:
            return
        for s in self.shard.values():
            s.grad = torch.zeros_like(s)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Plain full tensors keyed like DCP's get_state_dict: {"model": {fqn: tensor},
        "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}}."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        self._ensure_optimizer_state()
        state = {self.fqn[p]: {} for p in self.shard}
        keys = list(optimizer.state[next(iter(self.shard.values()))].keys())
        for key in keys:
            sharded = optimizer.state[next(iter(self.shard.values()))][key].dim() > 0  # not "step"
            full = self.gather_full(lambda p: optimizer.state[self.shard[p]][key]) if sharded else {}
            for p, s in self.shard.items():
                state[self.fqn[p]][key] = full[p] if sharded else optimizer.state[s][key].clone()
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self.fqn[self.full_of[s]] for s in g["params"]]} for g in optimizer.param_groups]
        return {"model": get_model_state_dict(self._state_module()),
                "optim": {"state": state, "param_groups": groups}}

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(self._state_module(), state["model"])
        self._ensure_optimizer_state()
        by_name = {self.fqn[p]: p for p in self.shard}
        with torch.no_grad():
            for name, saved in state["optim"]["state"].items():
                p = by_name[name]
                mine = optimizer.state[self.shard[p]]
                for key, value in saved.items():
                    value = value.full_tensor() if hasattr(value, "full_tensor") else value
                    if mine[key].dim() == 0:
                        mine[key].copy_(value)
                    else:
                        spec = self.spec[p]
                        mine[key].copy_(value.reshape(-1)[spec.lo:spec.hi])
        for group, saved in zip(optimizer.param_groups, state["optim"]["param_groups"]):
            group.update({k: v for k, v in saved.items() if k not in _KERNEL_KEYS})


class Zero1Strategy(_ElementShardedZero, DDPStrategy):
    """Stage 1: DDP all-reduces full gradients (wrap_data_parallel and no_sync come from
    DDPStrategy); each rank's optimizer reads its slice of them (views, no copy)."""

    stage = 1

    def forward_backward(self, x, y, scale_loss=lambda l: l):
        loss = super().forward_backward(x, y, scale_loss)
        for p, s in self.shard.items():
            spec = self.spec[p]
            s.grad = p.grad.view(-1)[spec.lo:spec.hi] if p.grad is not None else None
        return loss

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()
        for p in self.shard:
            p.grad = None  # the optimizer's zero_grad only sees the slices


class Zero2Strategy(_ElementShardedZero):
    """Stage 2: gradients reduce-scattered bucket by bucket during backward; only the slice
    stays (see module doc)."""

    stage = 2

    def __init__(self, *args, **kwargs):
        self._end_of_backward_queued = False
        super().__init__(*args, **kwargs)

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        for p in model.parameters():  # unique: a tied matrix gets one hook
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        return model

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._end_of_backward_queued:  # flush unused parameters' buckets at the end
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._reduce(bucket)

    def _reduce(self, bucket: ShardBucket) -> None:
        with torch.no_grad():
            fulls = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            for p, part in zip(bucket.params, bucket.reduce_scatter(fulls)):
                s = self.shard[p]
                if s.grad is None:
                    s.grad = part
                else:
                    s.grad.add_(part)  # gradient accumulation: slices add up over micro-batches
                p.grad = None
        bucket.reduced = True

    def _end_of_backward(self) -> None:
        for b in self.buckets:  # same buckets on every rank: parameters unused in this graph
            if not b.reduced:
                self._reduce(b)
            b.ready, b.reduced = 0, False
        self._end_of_backward_queued = False

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        full = self.gather_full(lambda p: self.shard[p].grad if self.shard[p].grad is not None
                                else torch.zeros(self.spec[p].length, device=self.device))
        return {self.fqn[p]: g.detach().float().cpu().clone() for p, g in full.items()
                if self.shard[p].grad is not None}

    def resident_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Adds the gradient slices (views into the reduce-scatter outputs, one storage per
        bucket) to the base count, which only sees the (freed) full gradients."""
        out = super().resident_bytes(optimizer)
        storages = {}
        for s in self.shard.values():
            if s.grad is not None and s.grad.numel():
                st = local_tensor(s.grad).untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        out["grads"] += sum(storages.values())
        return out


class Zero3Strategy(FSDPStrategy, ZeroStrategy):
    """Stage 3: FSDP2 fully_shard per block + root, parameters resharded after forward."""

    name = "zero"

    @property
    def reshard_after_forward(self) -> bool:
        return True

    def describe_dp(self) -> str:
        if self.dp_size == 1:
            return "zero-3 (one data-parallel rank: nothing to shard)"
        return "zero-3 (FSDP2 fully_shard per block + root, parameters resharded after forward)"
