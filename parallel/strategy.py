"""The strategy interface: everything the Trainer may ask of a parallel layout.

The Trainer never looks at `parallel.strategy`; it calls the methods of the `Strategy` that
`parallel.build_strategy` returns. `parallel.strategy` picks what runs on the data-parallel
dimension, so the subclasses are data-parallel engines, one per file (`ddp.py`, `zero.py`,
`fsdp.py`, `dp.py`), each overriding only the hooks it changes: how a module is wrapped
(`wrap_data_parallel`), the optimizer, clipping, state dicts. This base class *is* the strategy
without data parallelism (`none`): one model replica, AdamW, DCP-ready state dicts.

Pipeline and tensor parallelism are not strategies: `setup` hands the model to
`parallel.parallelize`, which splits it for the layout and returns the StepRunner that runs this
rank's forward and backward (parallel/step.py: a micro-batch loop, or parallel/pp.py: a pipeline
schedule). Whatever depends on the pipeline split goes through that runner.

Layout of one step, as the Trainer drives it:
    loss = strategy.forward_backward(x, y, scale_loss)   # this rank's (B/dp, T) share
    scaler.unscale_(optimizer)                           # fp16 only
    norm = strategy.clip_grad_norm_(max_norm)
    optimizer.step(); strategy.after_optimizer_step(); optimizer.zero_grad()
    strategy.reduce_mean(loss)                           # only on log steps: one collective
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from config import Config
from model import GPT
from parallel.adamw import MeshwiseAdamW
from parallel.dtensor import full_tensor, local_tensor, same_layout_groups, settle_partial_grads, storage_id
from parallel.env import DistEnv, cpu_devices, local_world_size
from parallel.layout import Layout, describe
from parallel.materialize import InitialValue
from parallel.muon import MuonWithAdamW, muon_parameter_ids
from parallel.parallelize import parallelize
from parallel.scaler import make_grad_scaler
from parallel.step import StepRunner

# Optimizer param-group keys that choose the kernel, not training state: a snapshot written by
# another layout (e.g. fused AdamW on plain tensors) must not impose its kernel on this one.
OPTIMIZER_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


class Strategy:
    """parallel.strategy=none: no data parallelism. Base class of every other strategy.

    Built in two steps: the constructor fixes the layout (what describe, the tracker rank and the
    batch split need: no model, no collective), `setup(model)` places the model on it. Every
    method below `setup` needs it done."""

    name = "none"
    # Does a dp rank hold only a shard of the gradients it steps? (fp16: agree on inf/nan over dp)
    grads_sharded = False

    def __init__(self, cfg: Config, env: DistEnv, layout: Layout | None = None, mesh: DeviceMesh | None = None):
        self.cfg = cfg
        self.env = env
        self.layout = layout or Layout.of(cfg, env.world_size)
        self.mesh = mesh
        self.device = env.device
        self.coordinate = self.layout.coordinate(env.rank)
        self.dp_size = self.layout.dp
        self.dp_rank = self.coordinate.dp
        self._runner: StepRunner | None = None

    # ------------------------------------------------------------------ layout

    def params_replicated_over(self) -> str | None:
        """The mesh dimension over which every rank holds the same local parameters (guards/replicas.py
        compares them there), or None."""
        return None

    def optimizer_replicated_over(self) -> str | None:
        """The mesh dimension over which every rank holds the same optimizer state, or None."""
        return None

    @property
    def tracker_rank(self) -> int:
        """Global rank of the one process that writes metrics and talks to wandb."""
        return self.layout.tracker_rank

    @property
    def is_tracker(self) -> bool:
        return self.env.rank == self.tracker_rank

    def describe(self) -> str:
        """The layout for the start-up line, each mesh dimension with what runs on it (layout.describe)."""
        if self.layout.world_size == 1:
            return self.describe_dp()  # one process: its strategy is the layout
        return describe(self.cfg, self.layout, self.describe_dp())

    def describe_dp(self) -> str:
        """One phrase for what parallel.strategy does on the dp dimension, e.g. 'ddp (bucket 25 MB)'."""
        return "none (one process, no parallelism)" if self.env.world_size == 1 else self.name

    @property
    def rng_gpus(self) -> list[int]:
        """The CUDA devices whose generators this rank draws from (dropout), each kept in a snapshot:
        this rank's own GPU, or none (an empty list) on the CPU."""
        return [self.device.index] if self.device.type == "cuda" else []

    @property
    def compute_precision(self) -> str:
        """The dtype the matmuls run in ("fp32", "bf16", "fp16"): what MFU's peak must be of.
        trainer.precision's autocast; engines that cast parameters themselves override it."""
        return self.cfg.trainer.precision

    @property
    def num_devices(self) -> float:
        """Devices this layout computes on, all processes together (MFU divides by their peak): one
        per process; on CPU the process peaks the cores really give (parallel/env.py cpu_devices)."""
        if self.device.type == "cpu":
            return cpu_devices(self.env.world_size, local_world_size(self.env.world_size))[0]
        return self.env.world_size

    # ------------------------------------------------------------------ setup

    # Does the engine shard the parameters (FSDP2)? Then it wraps the model on the meta device and
    # only this rank's shards are ever allocated (parallel/materialize.py).
    shards_parameters = False

    @property
    def init_device(self) -> torch.device:
        """Where this rank's parameters are allocated: its device (FSDP2's CPU offload: the CPU)."""
        return self.device

    def setup(self, model: GPT, initial: InitialValue | None = None) -> None:
        """Place the model on the layout (what it costs whole: GPT.cost, read before this call): a
        GPT on the meta device, filled with `initial` (parallel/materialize.py), or one already built."""
        self._runner = parallelize(model, self.cfg, self.layout, self.mesh, self.env, self.wrap_data_parallel,
                                   initial, self.shards_parameters, self.init_device)

    @property
    def runner(self) -> StepRunner:
        if self._runner is None:
            raise RuntimeError("Strategy.setup(model) places the model; call it before training")
        return self._runner

    def wrap_data_parallel(self, module: nn.Module) -> nn.Module:
        """`module` (a GPT or one pipeline stage, already tensor-parallel) under this strategy's
        data-parallel engine on mesh["dp"]."""
        return module

    @property
    def model(self) -> nn.Module | None:
        """The module mapping ids -> logits on this rank (None under a pipeline)."""
        return self.runner.model

    def unwrapped(self) -> list[nn.Module]:
        """The GPT modules (or the pipeline's view of this rank's stages) with plain parameter names."""
        return self.runner.parts

    def param_groups(self) -> list[dict]:
        return decay_groups(self.unwrapped(), self.cfg.optimizer.weight_decay)

    def adamw(self, groups: list[dict]) -> torch.optim.AdamW:
        """AdamW with the configured hyper-parameters, fused (CPU and CUDA both have the kernel):
        torch's own where every parameter is of one kind (all plain tensors, or all DTensors on one
        mesh), else one fused call per kind (parallel/adamw.py: tensor parallelism leaves some
        parameters plain); torch's default for another tensor subclass, which the kernel may not
        take. That default on a CPU is a loop over the parameters, about 10 ops each, every one a
        DTensor dispatch on sharded ones: an FSDP2 step of 8 blocks of 256 spent 15.7 ms in AdamW
        where the fused kernel takes 3.5 (docs/planner.md)."""
        o = self.cfg.optimizer
        hyper = {"lr": o.lr, "betas": (o.beta1, o.beta2)}
        kinds = parameter_kinds(groups)
        if None in kinds:
            return torch.optim.AdamW(groups, **hyper)
        return torch.optim.AdamW(groups, fused=True, **hyper) if len(kinds) == 1 else MeshwiseAdamW(groups, **hyper)

    def build_optimizer(self) -> torch.optim.Optimizer:
        if self.cfg.optimizer.name == "muon":  # DTensor shards gathered per matrix; ZeRO-1/2 refused (options.py)
            return self.muon_with_adamw()
        return self.adamw(self.param_groups())

    def muon_with_adamw(self) -> MuonWithAdamW:
        o, parts = self.cfg.optimizer, self.unwrapped()
        hidden = muon_parameter_ids(parts)
        groups = self.param_groups()
        muon = [dict(g, params=[p for p in g["params"] if id(p) in hidden]) for g in groups]
        rest = [dict(g, params=[p for p in g["params"] if id(p) not in hidden]) for g in groups]
        return MuonWithAdamW(muon, rest, lr=o.lr, adamw=self.adamw)

    def make_grad_scaler(self):
        return make_grad_scaler(self.cfg, self.layout, self.mesh, self.device, self.grads_sharded)

    # ------------------------------------------------------------------ step

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor,
                         scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda l: l) -> torch.Tensor:
        """Forward + backward over this rank's share (B/dp, T); gradients end up averaged over the
        global batch. Returns this rank's mean loss (detached)."""
        loss = self.runner.forward_backward(x, y, scale_loss)
        if self.layout.tp_enabled:  # only tensor parallelism leaves Partial gradients
            settle_partial_grads(self.unwrapped())
        return loss

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of this rank's share of one validation batch (no gradients)."""
        return self.runner.eval_loss(x, y)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping. max_norm=0 only
        measures it. Gradients may mix plain tensors (replicated: counted once) and DTensors on
        different meshes/placements (tp/fsdp shards: their norms are reduced over their mesh);
        under pp every stage adds its share of the squared norm."""
        params = [p for p in {id(p): p for part in self.unwrapped() for p in part.parameters()}.values()
                  if p.grad is not None]
        squared = torch.zeros((), device=self.device)
        for group in same_layout_groups([p.grad for p in self.runner.norm_parameters() if p.grad is not None]):
            squared += full_tensor(torch.nn.utils.get_total_norm(group, 2.0, foreach=None)).float() ** 2
        self.runner.sum_over_stages(squared)
        total = squared.sqrt()
        if max_norm > 0:
            for group in same_layout_groups(params):
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=None)
        return total

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel ranks of a per-rank scalar held by the loss owners; returned on
        every rank (under pp, non-owners contribute zero and receive the result)."""
        if not self.env.distributed:
            return value.detach().float()
        counted = self.runner.loss_owner and self.coordinate.tp == 0  # tp peers hold the same loss
        v = value.detach().float().clone() if counted else torch.zeros((), device=self.device)
        dist.all_reduce(v)
        # cp ranks each hold the mean over as many tokens of the same sequences (parallel/cp.py)
        return v / self.layout.grad_ranks

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Collective. Every parameter's whole gradient by plain name, on every rank: what parity
        tests compare against one process. Sharded strategies gather their shards."""
        out = {}
        for part in self.unwrapped():
            for name, p in part.named_parameters():
                if p.grad is not None:
                    out[name] = full_tensor(p.grad).detach().float().cpu().clone()
        return self.runner.merge_over_stages(out)

    def after_optimizer_step(self) -> None:
        """Hook after optimizer.step(). Subclasses that override it call super()."""
        self.runner.after_optimizer_step()

    # ------------------------------------------------------------------ state

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Model and optimizer state keyed by plain parameter names, in DCP's sharded form: a
        snapshot written by any strategy loads into any other and any world size."""
        model_sd, optim_sd = get_state_dict(self.unwrapped()[0], optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """The snapshot's tensors and param-group values; this layout keeps its own optimizer kernel
        (the snapshot's groups carry the flags of the strategy that wrote it, e.g. fused AdamW for
        plain tensors, which DTensor parameters cannot use)."""
        kernels = [{k: g[k] for k in OPTIMIZER_KERNEL_KEYS if k in g} for g in optimizer.param_groups]
        set_state_dict(self.unwrapped()[0], optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        for group, kernel in zip(optimizer.param_groups, kernels):
            group.update(kernel)
        self.after_optimizer_step()

    def full_model_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. The whole model's plain CPU tensors on global rank 0 (None elsewhere): for
        tests that compare whole models (model.pt is written from full_tensors)."""
        return self.runner.full_model_state_dict(self.env.rank)

    def full_tensors(self, names: dict[str, torch.Tensor]):
        """Collective, one tensor at a time: (name, whole CPU tensor on rank 0, None elsewhere) for
        each of `names` (name -> meta tensor of its shape), in order; every rank iterates to the end."""
        return self.runner.full_tensors(self.env.rank, names)

    def resident_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return resident_bytes(self.runner.held_modules(), optimizer)


def decay_groups(parts: list[nn.Module], weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices (embeddings, linear weights), not biases or LayerNorm."""
    seen, decay, no_decay = set(), [], []
    for part in parts:
        for p in part.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def resident_bytes(parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank actually holds for parameters, gradients and optimizer state, read from
    the local tensors (a DTensor counts its local shard; a shared tensor counts once)."""
    seen: set[int] = set()

    def nbytes(ts) -> int:
        total = 0
        for t in ts:
            if t is None or not torch.is_tensor(t):
                continue
            loc = local_tensor(t)
            key = storage_id(loc) if loc.numel() else id(loc)
            if key in seen:
                continue
            seen.add(key)
            total += loc.untyped_storage().nbytes() if loc.numel() else 0
        return total

    params = [p for part in parts for p in part.parameters()]
    return {"params": nbytes(params), "grads": nbytes([p.grad for p in params]),
            "optimizer": nbytes([v for st in optimizer.state.values() for v in st.values()
                                 if torch.is_tensor(v) and v.dim() > 0])}


def parameter_kinds(groups: list[dict]) -> set:
    """The kinds of parameter in these groups: "plain" (a tensor or nn.Parameter), each DeviceMesh
    that DTensors live on (equal when the same ranks and dims), None for another tensor subclass."""
    return {"plain" if type(p) in (torch.Tensor, nn.Parameter) else p.device_mesh if isinstance(p, DTensor)
            else None for g in groups for p in g["params"]}


def fusable(groups: list[dict]) -> bool:
    """Does one fused optimizer take these parameter groups? Every parameter plain, or every one a
    DTensor on one mesh (FSDP2's shards, HSDP's); not a DTensor/plain mix, DTensors on two meshes
    (fsdp x tp: the LayerNorms on the dp mesh, the tp weights on the 2-D one) or another subclass."""
    kinds = parameter_kinds(groups)
    return len(kinds) == 1 and None not in kinds
