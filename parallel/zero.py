"""parallel.strategy=zero: ZeRO stages 1, 2 and 3 (`parallel.zero_stage`).

Per-rank bytes for fp32 AdamW with a parameters on n data-parallel ranks (Rajbhandari et al. 2020,
"ZeRO", section 5; measured by tests/test_data_parallel.py and benchmarks/memory_per_strategy.py):

    stage 1  params 4a + grads 4a    + Adam state 8a/n  (optimizer state sharded)
    stage 2  params 4a + grads 4a/n  + Adam state 8a/n  (+ gradients sharded)
    stage 3  params 4a/n + grads 4a/n + Adam state 8a/n (+ parameters sharded) = 16a/n

Stages 1 and 2 shard by ELEMENT, not by tensor (parallel/zero_shard.py: each rank owns 1/n of
every tensor, to within one element per tensor).
torch's ZeroRedundancyOptimizer assigns WHOLE tensors to ranks (greedy by size), which on a GPT
leaves ranks unbalanced (measured in benchmarks/memory_per_strategy.py), and torch has no engine
for stage 2 at all, so both are built here on reduce_scatter_single / all_gather_single (torch
2.13's names for reduce_scatter_tensor / all_gather_into_tensor, which now warn as deprecated):

- A rank's optimizer works on slices that are views into the full parameters' storage (no
  extra copy of the weights). AdamW state exists only for those slices. The shard plan (slices
  and buckets) is fixed when the model is placed (`setup`).
- stage 1: gradients are all-reduced by DDP (buckets, no_sync for accumulation, all DDP options);
  each rank's optimizer steps its slice, then the updated slices are all-gathered into every
  rank's full parameters. Traffic: DDP's all-reduce (2K(n-1)/n) + an all-gather (K(n-1)/n).
- stage 2: no DDP. A post-accumulate-grad hook per parameter reduce-scatters each finished
  bucket during backward and frees the full gradients, so only this rank's averaged slice
  (4a/n) survives. This runs on EVERY micro-batch (slices accumulate): full gradients never pile
  up, at the price of one reduce-scatter per micro-batch (no_sync does not apply).
- clip_grad_norm_ all-reduces the squared norms of the slices (the global norm); fp16 uses
  a grad scaler whose inf check is all-reduced over the dp group (parallel/scaler.py).
- state_dict gathers the full AdamW state into plain tensors keyed by parameter name, exactly
  like DCP's get_state_dict (so a snapshot loads into any strategy and world size); saving thus
  briefly holds 8a of optimizer state per rank. load_state_dict slices it back.
Stages 1 and 2 need plain (non-DTensor) parameters: with parallel.tp or pp > 1 the layout check
refuses them; stage 3 composes (it is FSDP2).

stage 3 is FSDP2 (`fully_shard` per block + root, parameters resharded after forward): the same
engine as parallel.strategy=fsdp with its options fixed (dim-0 sharding, padding up to one dim-0
row per tensor).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from model import GPT
from parallel.ddp import wrap_ddp
from parallel.dtensor import full_tensor, local_tensor
from parallel.fsdp import FSDPStrategy
from parallel.strategy import OPTIMIZER_KERNEL_KEYS, Strategy
from parallel.zero_shard import ShardBucket, ShardPlan


class ElementShardedZero(Strategy):
    """Stages 1 and 2: replicated parameters, element-sharded AdamW state (see module doc)."""

    name = "zero"
    stage = 0
    grads_sharded = True  # the optimizer steps slices: fp16 agrees on inf/nan over dp

    def describe_dp(self) -> str:
        sharded = "optimizer state" if self.stage == 1 else "optimizer state + gradients"
        return (f"zero-{self.stage} ({sharded} sharded by element over {self.dp_size} ranks, "
                f"bucket {self.cfg.parallel.bucket_cap_mb:g} MB)")

    @property
    def dp_group(self):
        return self.mesh["dp"].get_group() if self.dp_size > 1 else None

    def setup(self, model: GPT) -> None:
        """Place the model, then fix this rank's slices and the buckets (the optimizer, the
        collectives and the state dicts all read this plan)."""
        super().setup(model)
        self.plan = ShardPlan(self.unwrapped(), self.param_groups(), self.dp_size, self.dp_rank,
                              self.cfg.parallel.bucket_cap_mb, self.dp_group)

    def build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over this rank's slices."""
        return self.adamw(self.plan.groups)

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()
        self.plan.gather_params()

    # ------------------------------------------------------------------ gradients

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global norm = sqrt(sum over ranks of this rank's slices' squared norms); the slices
        partition every gradient, so nothing is counted twice. Same clip rule as torch's."""
        grads = [s.grad for s in self.plan.shard.values() if s.grad is not None]
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

    # ------------------------------------------------------------------ state

    def _ensure_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """AdamW creates its state on the first step; a template for loading needs it now. Same
        trick as DCP's get_state_dict: one step with zero gradients and lr 0 (changes nothing)."""
        if optimizer.state:
            return
        for s in self.plan.shard.values():
            s.grad = torch.zeros_like(s)
        lrs = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        optimizer.step()
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Plain full tensors keyed like DCP's get_state_dict: {"model": {fqn: tensor},
        "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}}."""
        self._ensure_optimizer_state(optimizer)
        plan = self.plan
        state = {plan.fqn[p]: {} for p in plan.shard}
        first = optimizer.state[next(iter(plan.shard.values()))]
        for key in list(first.keys()):
            sharded = first[key].dim() > 0  # not "step"
            full = plan.gather_full(lambda p: optimizer.state[plan.shard[p]][key]) if sharded else {}
            for p, s in plan.shard.items():
                state[plan.fqn[p]][key] = full[p] if sharded else optimizer.state[s][key].clone()
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [plan.fqn[plan.full_of[s]] for s in g["params"]]} for g in optimizer.param_groups]
        return {"model": get_model_state_dict(self.unwrapped()[0]),
                "optim": {"state": state, "param_groups": groups}}

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        set_model_state_dict(self.unwrapped()[0], state["model"])
        self._ensure_optimizer_state(optimizer)
        plan = self.plan
        by_name = {plan.fqn[p]: p for p in plan.shard}
        with torch.no_grad():
            for name, saved in state["optim"]["state"].items():
                p = by_name[name]
                mine = optimizer.state[plan.shard[p]]
                for key, value in saved.items():
                    value = full_tensor(value)
                    if mine[key].dim() == 0:
                        mine[key].copy_(value)
                    else:
                        spec = plan.spec[p]
                        mine[key].copy_(value.reshape(-1)[spec.lo:spec.hi])
        for group, saved in zip(optimizer.param_groups, state["optim"]["param_groups"]):
            group.update({k: v for k, v in saved.items() if k not in ("params", *OPTIMIZER_KERNEL_KEYS)})


class Zero1Strategy(ElementShardedZero):
    """Stage 1: DDP all-reduces full gradients (bucketed, no_sync during accumulation, every DDP
    option); each rank's optimizer reads its slice of them (views, no copy)."""

    stage = 1

    def wrap_data_parallel(self, module: nn.Module) -> nn.Module:
        return wrap_ddp(module, self.cfg, self.layout, self.mesh, self.env)

    def forward_backward(self, x, y, scale_loss=lambda l: l):
        loss = super().forward_backward(x, y, scale_loss)
        for p, s in self.plan.shard.items():  # the slices' gradients: views of the reduced full ones
            spec = self.plan.spec[p]
            s.grad = p.grad.view(-1)[spec.lo:spec.hi] if p.grad is not None else None
        return loss

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()
        for p in self.plan.shard:
            p.grad = None  # the optimizer's zero_grad only sees the slices


class Zero2Strategy(ElementShardedZero):
    """Stage 2: gradients reduce-scattered bucket by bucket during backward; only the slice
    stays (see module doc)."""

    stage = 2

    def setup(self, model: GPT) -> None:
        super().setup(model)
        self._end_of_backward_queued = False
        for p in self.plan.shard:  # unique: a tied matrix gets one hook
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._end_of_backward_queued:  # flush unused parameters' buckets at the end
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self.plan.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._reduce(bucket)

    def _reduce(self, bucket: ShardBucket) -> None:
        with torch.no_grad():
            fulls = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            for p, part in zip(bucket.params, bucket.reduce_scatter(fulls)):
                s = self.plan.shard[p]
                if s.grad is None:
                    s.grad = part
                else:
                    s.grad.add_(part)  # gradient accumulation: slices add up over micro-batches
                p.grad = None
        bucket.reduced = True

    def _end_of_backward(self) -> None:
        for b in self.plan.buckets:  # same buckets on every rank: parameters unused in this graph
            if not b.reduced:
                self._reduce(b)
            b.ready, b.reduced = 0, False
        self._end_of_backward_queued = False

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        plan = self.plan
        full = plan.gather_full(lambda p: plan.shard[p].grad if plan.shard[p].grad is not None
                                else torch.zeros(plan.spec[p].length, device=self.device))
        return {plan.fqn[p]: g.detach().float().cpu().clone() for p, g in full.items()
                if plan.shard[p].grad is not None}

    def resident_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Adds the gradient slices (views into the reduce-scatter outputs, one storage per
        bucket) to the base count, which only sees the (freed) full gradients."""
        out = super().resident_bytes(optimizer)
        storages = {}
        for s in self.plan.shard.values():
            if s.grad is not None and s.grad.numel():
                st = local_tensor(s.grad).untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        out["grads"] += sum(storages.values())
        return out


class Zero3Strategy(FSDPStrategy):
    """Stage 3: FSDP2 fully_shard per block + root, parameters resharded after forward."""

    name = "zero"

    @property
    def reshard_after_forward(self) -> bool:
        return True

    def describe_dp(self) -> str:
        if self.dp_size == 1:
            return "zero-3 (one data-parallel rank: nothing to shard)"
        return "zero-3 (FSDP2 fully_shard per block + root, parameters resharded after forward)"
