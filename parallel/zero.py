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
for stage 2 at all, so both are built here, on a reduce-scatter that moves a ring's volume on
every backend (parallel/collectives.py) and all_gather_single:

- A rank's optimizer works on slices that are views into the full parameters' storage (no
  extra copy of the weights). AdamW state exists only for those slices. The shard plan (slices
  and buckets) is fixed when the model is wrapped (`wrap_data_parallel`, during setup).
- Gradients are reduce-scattered bucket by bucket during backward (`ZeroDataParallel`, the
  engine module); after the optimizer step the updated slices are all-gathered into every rank's
  full parameters. Traffic per step for K bytes of parameters: K(n-1)/n + K(n-1)/n = 2K(n-1)/n
  per rank, what DDP's all-reduce moves (Rajbhandari et al. 2020, section 7).
- stage 1 keeps full gradients (4a) and accumulates micro-batches locally: it reduces in the
  last micro-batch's backward only. stage 2 reduces on EVERY micro-batch and frees the full
  gradients, so only this rank's slice (4a/n) survives, at the price of one reduce-scatter per
  micro-batch.
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

from parallel.dtensor import full_tensor, local_tensor, storage_id
from parallel.fsdp import FSDPStrategy
from parallel.strategy import OPTIMIZER_KERNEL_KEYS, Strategy, decay_groups
from parallel.zero_shard import ShardPlan, ZeroDataParallel


class ElementShardedZero(Strategy):
    """Stages 1 and 2: replicated parameters, element-sharded AdamW state (see module doc)."""

    name = "zero"
    stage = 0
    grads_sharded = True  # the optimizer steps slices: fp16 agrees on inf/nan over dp

    def describe_dp(self) -> str:
        sharded = "optimizer state" if self.stage == 1 else "optimizer state + gradients"
        return (f"zero-{self.stage} ({sharded} sharded by element over {self.dp_size} ranks, "
                f"bucket {self.cfg.parallel.bucket_cap_mb:g} MB)")

    def params_replicated_over(self) -> str | None:
        return "dp"  # whole parameters (re-copied from each slice's owner after every step); the AdamW state is sharded

    def wrap_data_parallel(self, module: nn.Module) -> nn.Module:
        """`module` under ZeroDataParallel, with this rank's shard plan."""
        group = self.mesh["dp"].get_group() if self.dp_size > 1 else None
        plan = ShardPlan([module], decay_groups([module], self.cfg.optimizer.weight_decay), self.dp_size,
                         self.dp_rank, self.cfg.parallel.bucket_cap_mb, group)
        return ZeroDataParallel(module, plan, keep_full_grads=self.stage == 1)

    @property
    def plan(self) -> ShardPlan:
        """This rank's shard plan (the optimizer, the collectives and the state dicts all read it),
        held by the wrapped module: ZeRO-1/2 run without pipeline stages (Layout.of), so there is
        one."""
        wrapped = self.runner.wrapped
        assert isinstance(wrapped, ZeroDataParallel), type(wrapped)
        return wrapped.plan

    def build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over this rank's slices."""
        return self.adamw(self.plan.groups)

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()
        self.plan.gather_params()
        for p in self.plan.shard:
            p.grad = None  # stage 1's full gradients: the optimizer's zero_grad only sees the slices

    # ------------------------------------------------------------------ gradients

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global norm = sqrt(sum over ranks of this rank's slices' squared norms); the slices
        partition every gradient, so nothing is counted twice. Same clip rule as torch's."""
        grads = [s.grad for s in self.plan.shard.values() if s.grad is not None]
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for g in grads:
            sq += g.float().pow(2).sum()
        if self.dp_size > 1:
            dist.all_reduce(sq, group=self.plan.group)
        norm = sq.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return norm

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the whole reduced gradients, gathered from every rank's slices."""
        plan = self.plan
        full = plan.gather_full(lambda p: plan.shard[p].grad if plan.shard[p].grad is not None
                                else torch.zeros(plan.spec[p].length, device=self.device))
        return {plan.fqn[p]: g.detach().float().cpu().clone() for p, g in full.items()
                if plan.shard[p].grad is not None}

    def resident_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Adds the gradient slices' storage (stage 2: the reduce-scatter outputs, one storage per
        bucket) when it is not already counted (stage 1: views into the full gradients)."""
        out = super().resident_bytes(optimizer)
        counted = {storage_id(local_tensor(p.grad)) for p in self.plan.shard if p.grad is not None}
        storages = {}
        for s in self.plan.shard.values():
            if s.grad is not None and s.grad.numel():
                st = local_tensor(s.grad)
                if storage_id(st) not in counted:
                    storages[storage_id(st)] = st.untyped_storage().nbytes()
        out["grads"] += sum(storages.values())
        return out

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
    """Stage 1: full gradients accumulate locally and are reduce-scattered in the last
    micro-batch's backward; each rank's optimizer reads its slice of them (views, no copy)."""

    stage = 1


class Zero2Strategy(ElementShardedZero):
    """Stage 2: gradients reduce-scattered bucket by bucket in every micro-batch's backward; only
    the slice stays (see module doc)."""

    stage = 2


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
