"""parallel.strategy=fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`) over the mesh's `dp` dimension.

`fully_shard` is applied to every transformer block and then to the root module (which keeps the
embeddings, final LayerNorm and LM head: the tied embedding/head matrix is one parameter, owned by
the root group once). Each parameter is stored as a DTensor sharded on dim 0 over the dp ranks, so
a rank holds 1/n of parameters, gradients and AdamW state: 16a/n bytes for fp32 Adam with a
parameters (plus padding: dim 0 is split with torch.chunk, so up to one dim-0 row per tensor).
Forward and backward all-gather one block's parameters just in time; backward reduce-scatters its
gradients (communication 3 x K(n-1)/n per step for K bytes of parameters, vs 2x for DDP; with
reshard_after_forward off, backward reuses forward's gather: 2x). On gloo the reduce-scatter is
parallel/collectives.py's (FSDP2's `set_custom_reduce_scatter` hook): gloo's own moves an
all-reduce's volume.

HSDP (`parallel.dp_replicate=R`): the dp ranks form R replica groups of dp/R ranks; FSDP2 gets
the 2-D mesh (dp_replicate, dp_shard), shards within a group and all-reduces the gradient shards
across groups (per rank 16a/(dp/R) bytes; the all-gathers stay inside a group, which is what
multi-node users want: put a group on one node's fast interconnect).

Options (all `parallel.`):
- reshard_after_forward: free a block's gathered parameters after its forward (ZeRO-3) or keep
  them until backward (no second all-gather; memory between ZeRO-2 and ZeRO-3).
- mixed_precision (none|bf16|fp16) + reduce_dtype: FSDP2's MixedPrecisionPolicy. Sharded fp32
  parameters stay the master weights; forward/backward run on gathered low-precision copies.
- cpu_offload: CPUOffloadPolicy, sharded parameters/gradients/optimizer state live in CPU memory
  (pin_memory only with an accelerator: pinning needs one).

Gradient accumulation: non-final micro-batches run with `set_requires_gradient_sync(False)`
(parallel/step.py `gradient_sync`), so gradients accumulate unsharded locally and are
reduce-scattered once per optimizer step.
With tp > 1 the parameters arriving here are already DTensors on the tp mesh: sharding them over
the dp sub-mesh is FSDP2's documented 2-D composition. With one dp rank there is nothing to shard
and the module is left as it is.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from parallel.collectives import RingReduceScatter
from parallel.env import DTYPES
from parallel.strategy import Strategy


class FSDPStrategy(Strategy):
    name = "fsdp"
    grads_sharded = True

    def params_replicated_over(self) -> str | None:
        return "dp_replicate" if self.layout.dp_replicate > 1 else None  # HSDP: each shard on every replica

    def optimizer_replicated_over(self) -> str | None:
        return self.params_replicated_over()

    # ------------------------------------------------------------------ options

    @property
    def reshard_after_forward(self) -> bool:
        return self.cfg.parallel.reshard_after_forward

    def mp_policy(self) -> MixedPrecisionPolicy:
        p = self.cfg.parallel
        param_dtype = DTYPES[p.mixed_precision] if p.mixed_precision != "none" else None
        # reduce_dtype=None would reduce in param_dtype; fp32 reduction is the safe default.
        reduce_dtype = DTYPES[p.reduce_dtype] if (param_dtype is not None or p.reduce_dtype != "fp32") else None
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def offload_policy(self) -> OffloadPolicy:
        if not self.cfg.parallel.cpu_offload:
            return OffloadPolicy()
        # Pinned host memory needs an accelerator; on a CPU-only machine pinning raises.
        return CPUOffloadPolicy(pin_memory=self.device.type == "cuda")

    @property
    def shards_parameters(self) -> bool:
        """Does fully_shard run? With more than one dp rank; in a world of one process only for CPU
        offload (a model kept in host memory and streamed to the GPU: the one-GPU use of FSDP), which
        needs a process group (torchrun --nproc_per_node=1). Layouts with tp or pp and one dp rank stay
        unwrapped: their stage shapes, grad scaler and plan assume no FSDP at dp 1. Under context
        parallelism FSDP2 shards over dp x cp (the cp ranks hold the same parameters), as torchtitan does."""
        return self.layout.grad_ranks > 1 or (self.cfg.parallel.cpu_offload and self.mesh is not None
                                    and self.env.world_size == 1)

    @property
    def init_device(self) -> torch.device:
        """FSDP2's CPU offload keeps the sharded parameters in host memory: they are allocated there."""
        return torch.device("cpu") if self.shards_parameters and self.cfg.parallel.cpu_offload else self.device

    @property
    def compute_precision(self) -> str:
        """parallel.mixed_precision casts the parameters for forward and backward: under an fp32
        trainer.precision the matmuls run in that dtype (MFU's peak is its)."""
        p = self.cfg.parallel
        if self.shards_parameters and p.mixed_precision != "none" and self.cfg.trainer.precision == "fp32":
            return p.mixed_precision
        return self.cfg.trainer.precision

    def describe_dp(self) -> str:
        if self.layout.cp_enabled:
            return f"{self.name} (FSDP2 per block + root, sharded over dp x cp = {self.layout.grad_ranks} ranks)"
        if self.dp_size == 1 and self.shards_parameters:
            return f"{self.name} (one data-parallel rank: FSDP2 for the cpu offload only)"
        if self.dp_size == 1:
            offload = (", parallel.cpu_offload runs only in a one-process torchrun launch"
                       if self.cfg.parallel.cpu_offload else "")
            return f"{self.name} (one data-parallel rank: nothing to shard{offload})"
        p, lay = self.cfg.parallel, self.layout
        extras = [f"params {p.mixed_precision}, reduce {p.reduce_dtype}"] if p.mixed_precision != "none" else []
        if lay.dp_replicate > 1:
            return (f"hsdp (FSDP2 sharded over {lay.dp_shard} ranks x replicated over {lay.dp_replicate} groups, "
                    f"reshard after forward {'on' if self.reshard_after_forward else 'off'}"
                    f"{''.join(', ' + e for e in extras)})")
        extras += ["cpu offload"] if p.cpu_offload else []
        return (f"{self.name} (FSDP2 per block + root, reshard after forward "
                f"{'on' if self.reshard_after_forward else 'off'}{''.join(', ' + e for e in extras)})")

    # ------------------------------------------------------------------ wrapping

    def wrap_data_parallel(self, module: nn.Module) -> nn.Module:
        """`module` (a GPT or one pipeline stage) under FSDP2 over the dp mesh, with this layout's
        options (`fully_shard_gpt`)."""
        if not self.shards_parameters:
            return module
        # HSDP: a 2-D mesh, (Replicate, Shard(0)): reduce-scatter within a replica group, then
        # all-reduce the shards across the groups.
        dp_mesh = self.mesh["dp_replicate", "dp_shard"] if self.layout.dp_replicate > 1 else self.mesh[self.layout.grad_dim]
        return fully_shard_gpt(module, ring_reduce_scatter=self.env.backend == "gloo", mesh=dp_mesh,
                               reshard_after_forward=self.reshard_after_forward, mp_policy=self.mp_policy(),
                               offload_policy=self.offload_policy())

    # clip_grad_norm_, full_grad_dict, state_dict/load_state_dict, full_model_state_dict and
    # resident_bytes come from the base class: they already handle DTensor parameters and
    # gradients (norm and full_tensor() reduce over the mesh, DCP's get_state_dict gives
    # plain-FQN DTensor state, resident bytes read each DTensor's local shard). fp16: the grad
    # scaler agrees on inf/nan over the dp group, dp x cp under cp (grads_sharded, parallel/scaler.py).


def fully_shard_gpt(module: nn.Module, ring_reduce_scatter: bool, **kwargs) -> nn.Module:
    """fully_shard (with `kwargs`) each transformer block of `module` (a GPT or one pipeline stage),
    then the module itself for what is left (embeddings, ln_f, head); with `ring_reduce_scatter`
    (gloo, whose own reduce-scatter moves all-reduce volume) every unit reduce-scatters with
    parallel/collectives.py's ring. tools/calibrate_engines.py times the same wrapping."""
    for block in module.blocks.values():
        fully_shard(block, **kwargs)
    # The root gets the same reshard_after_forward, so it is gathered again in backward like
    # every block: exactly ZeRO-3's 3K(n-1)/n. torch's default for a root (None) keeps it
    # gathered instead, which would save one all-gather of the embeddings and head per
    # micro-batch (their parameters are the last of forward and the first of backward); the
    # planner and docs/layouts.md state the volume this code moves.
    fully_shard(module, **kwargs)
    if ring_reduce_scatter:
        for m in [*module.blocks.values(), module]:
            m.set_custom_reduce_scatter(RingReduceScatter())
    return module
