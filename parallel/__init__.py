"""The strategy interface: everything the Trainer may ask of a parallel layout.

The Trainer never looks at `parallel.strategy`; it calls the methods of the `Strategy` that
`build_strategy` returns. This base class *is* the single-process strategy (`none`): one model on
one device, micro-batch gradient accumulation, AdamW, DCP-ready state dicts. Each data-parallel
strategy lives in its own file (`ddp.py`, `zero.py`, `fsdp.py`, `dp.py`) and overrides only the
hooks it changes: how the model is wrapped (`wrap_data_parallel`), how accumulation skips
communication (`no_sync`), the optimizer, the grad scaler, clipping and state dicts.

Model parallelism composes with any of them here, in `parallelize`: pipeline split on mesh["pp"]
(parallel/pp.py) -> tensor parallel on mesh["tp"] per stage (parallel/tp.py) -> activation
checkpointing -> `wrap_data_parallel(part)` per stage on mesh["dp"] -> compile. With pp > 1,
forward_backward/eval_loss delegate to a `parallel.pp.Pipeline` (one schedule step per optimizer
step, loss on the last stage), and `unwrapped()` is its GPT-shaped view of this rank's stages, so
optimizer groups, clipping, gradients and DCP state keep plain one-process parameter names.

Layout of one step, as the Trainer drives it:
    loss = strategy.forward_backward(x, y, scale_loss)   # this rank's (B/dp, T) share
    scaler.unscale_(optimizer)                           # fp16 only
    norm = strategy.clip_grad_norm_(max_norm)
    optimizer.step(); optimizer.zero_grad()
    strategy.reduce_mean(loss)                           # only on log steps: one collective
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from config import Config, UsageError
from model import GPT, lm_loss
from parallel.mesh import DistEnv, build_mesh, mesh_shape

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Optimizer param-group keys that choose the kernel, not training state.
OPTIMIZER_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor) tensor that lives on this rank."""
    return t.to_local() if hasattr(t, "to_local") else t


def _same_layout_groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split into plain tensors and DTensors per (mesh, placements) (of a parameter: of its
    gradient): foreach kernels take neither a DTensor/plain mix nor mixed meshes."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        g = t.grad if isinstance(t, nn.Parameter) and t.grad is not None else t
        key = (id(g.device_mesh), tuple(g.placements)) if hasattr(g, "device_mesh") else ()
        groups.setdefault(key, []).append(t)
    return list(groups.values())


class Strategy:
    """parallel.strategy=none: one process, one device. Base class of every other strategy."""

    name = "none"
    # Can wrap_data_parallel take tensor-parallel (DTensor) parameters when dp > 1?
    takes_tensor_parallel_params = True

    def __init__(self, cfg: Config, env: DistEnv, mesh=None):
        self.cfg = cfg
        self.env = env
        self.mesh = mesh
        self.device = env.device
        pp, dp, tp = mesh_shape(cfg, env.world_size)
        self.dp_size = dp
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self.model_parts: list[nn.Module] = []
        self.model: nn.Module | None = None  # the module whose forward maps ids -> logits
        self.pipeline = None  # parallel.pp.Pipeline when pp > 1: it runs forward/backward
        self.loss_owner = True  # does this rank compute the loss? (pipeline: last stage only)
        self.validate_layout()

    # ------------------------------------------------------------------ layout

    @property
    def per_rank_batch(self) -> int:
        return self.cfg.trainer.batch_size // self.dp_size

    @property
    def micro_batch_size(self) -> int:
        if self.cfg.parallel.pp > 1:  # one pipeline schedule per step, over M micro-batches
            from parallel.pp import pipeline_microbatches
            return self.per_rank_batch // pipeline_microbatches(self.cfg, self.per_rank_batch)
        return self.cfg.trainer.micro_batch_size or self.per_rank_batch

    @property
    def grad_accum_steps(self) -> int:
        return self.per_rank_batch // self.micro_batch_size

    def validate_layout(self) -> None:
        """World-size-dependent checks (config-only checks are in config.validate)."""
        t = self.cfg.trainer
        if t.batch_size % self.dp_size:
            raise UsageError(f"trainer.batch_size={t.batch_size} is not divisible by the "
                             f"{self.dp_size} data-parallel ranks; use a multiple of {self.dp_size}")
        p = self.cfg.parallel
        if p.tp > 1 and self.dp_size > 1 and not self.takes_tensor_parallel_params:
            raise UsageError(f"parallel.strategy={self.name} cannot data-parallelize tensor-parallel "
                             f"(DTensor) parameters; with parallel.tp > 1 and {self.dp_size} dp ranks use "
                             f"parallel.strategy=fsdp")
        if p.pp > 1:
            from parallel.pp import pipeline_microbatches
            pipeline_microbatches(self.cfg, self.per_rank_batch)  # raises UsageError
            if p.pp_schedule == "zero_bubble" and self.dp_size > 1:
                # Measured: split input/weight backward passes leave DDP's all-reduce and FSDP's
                # reduce-scatter with wrong or missing gradients (torch 2.13).
                raise UsageError("parallel.pp_schedule=zero_bubble does not compose with data parallelism "
                                 f"({self.dp_size} dp ranks): use 1f1b or interleaved_1f1b, or dp = 1")
        if self.per_rank_batch % self.micro_batch_size:
            raise UsageError(f"trainer.micro_batch_size={t.micro_batch_size} does not divide the "
                             f"per-rank batch {self.per_rank_batch} (= batch_size / dp ranks); pick a "
                             f"divisor of {self.per_rank_batch}")

    @property
    def tracker_rank(self) -> int:
        """Global rank of the one process that writes metrics and talks to wandb: it holds the
        reduced loss (global rank 0, or the first rank of the last pipeline stage)."""
        if self.cfg.parallel.pp == 1:
            return 0
        from parallel.pp import last_stage_pp_rank
        return last_stage_pp_rank(self.cfg) * self.dp_size * self.cfg.parallel.tp  # mesh (pp, dp, tp)

    @property
    def is_tracker(self) -> bool:
        return self.env.rank == self.tracker_rank

    def describe(self) -> str:
        """The layout for the start-up line, each mesh dimension with what runs on it, e.g.
        'pp 2 (1f1b, 4 micro-batches) x dp 2 (ddp, ...) x tp 2 (megatron ...)'. parallel.strategy
        acts on the dp dimension only, so a dp of 1 does not name it: a tp=2 run is not 'ddp'."""
        p = self.cfg.parallel
        if self.env.world_size == 1 and p.pp == 1 and p.tp == 1:  # one process: its strategy is the layout
            return self.describe_dp()
        pp = "pp 1"
        if p.pp > 1:
            from parallel.pp import pipeline_microbatches
            per_rank = f", {p.pp_stages_per_rank} stages per rank" if p.pp_stages_per_rank > 1 else ""
            pp = (f"pp {p.pp} ({p.pp_schedule}, {pipeline_microbatches(self.cfg, self.per_rank_batch)} "
                  f"micro-batches{per_rank})")
        dp = f"dp {self.dp_size} ({self.describe_dp()})" if self.dp_size > 1 else "dp 1"
        tp = "tp 1"
        if p.tp > 1:
            extras = (", vocab-parallel embedding + loss" if p.tp_vocab_parallel else "") + \
                     (", sequence parallel" if p.sequence_parallel else "")
            tp = f"tp {p.tp} (megatron column/row split of every block{extras})"
        return f"{pp} x {dp} x {tp}"

    def describe_dp(self) -> str:
        """One phrase for what parallel.strategy does on the dp dimension, e.g. 'ddp (bucket 25 MB)'."""
        return "none (one process, no parallelism)" if self.env.world_size == 1 else self.name

    @property
    def num_devices(self) -> int:
        """Devices this layout computes on, all processes together (MFU divides by their peak):
        one per process."""
        return self.env.world_size

    # ------------------------------------------------------------------ setup

    def setup(self, model: GPT) -> None:
        """Record what the whole model costs (before any split), then parallelize it."""
        self.flops_per_token = model.flops_per_token()
        self.num_params = model.num_params(exclude_position=False)
        self.parallelize(model)

    def parallelize(self, model: GPT) -> None:
        """Place `model` (built identically on every rank from the same seed) onto this layout:
        pipeline split on mesh["pp"] -> tensor parallel on mesh["tp"] (per stage) -> activation
        checkpointing -> data parallel on mesh["dp"] (per stage) -> compile."""
        p = self.cfg.parallel
        model.to(self.device)
        parts = [model]
        if p.pp > 1:
            from parallel.pp import Pipeline
            self.pipeline = Pipeline(model, self.cfg, self.mesh, self.device, self.per_rank_batch)
            parts = self.pipeline.stage_modules
            self.loss_owner = self.pipeline.holds_last
        if p.tp > 1:
            from parallel.tp import apply_tensor_parallel
            for part in parts:
                apply_tensor_parallel(part, self.mesh["tp"], p.tp_vocab_parallel, p.sequence_parallel)
        for part in parts:
            for block in part.blocks.values():
                block.activation_checkpointing = p.activation_checkpointing
        wrapped = [self.wrap_data_parallel(part) for part in parts]
        if self.pipeline is None:
            self.model = torch.compile(wrapped[0]) if self.cfg.trainer.compile else wrapped[0]
            self.model_parts = [model]
            return
        if self.cfg.trainer.compile:  # in place per block: the stage must stay the DDP/FSDP module
            for part in parts:
                for block in part.blocks.values():
                    block.compile()
        self.pipeline.build_schedule(wrapped)
        self.model_parts = [self.pipeline.state_view]

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        return model

    def unwrapped(self) -> list[nn.Module]:
        """The GPT modules (or pipeline stages) with their plain parameter names."""
        return self.model_parts

    def param_groups(self) -> list[dict]:
        """AdamW groups: decay matrices (embeddings, linear weights), not biases or LayerNorm."""
        seen, decay, no_decay = set(), [], []
        for part in self.unwrapped():
            for p in part.parameters():
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                (decay if p.dim() >= 2 else no_decay).append(p)
        return [{"params": decay, "weight_decay": self.cfg.optimizer.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def _adamw_kernel(self, params: list[torch.Tensor]) -> dict:
        """fused on plain tensors (CPU and CUDA both have it); DTensor params use torch's
        default (fused/foreach do not take a mix of DTensor and plain tensors)."""
        plain = all(type(p) in (torch.Tensor, nn.Parameter) for p in params)
        return {"fused": True} if plain else {}

    def build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optimizer
        groups = self.param_groups()
        params = [p for g in groups for p in g["params"]]
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), **self._adamw_kernel(params))

    def make_grad_scaler(self):
        """fp16 needs loss scaling (its 5-bit exponent underflows small gradients); bf16/fp32 do not."""
        if self.cfg.trainer.precision != "fp16":
            return None
        if self.cfg.parallel.tp > 1 or self.cfg.parallel.pp > 1:
            # Each rank sees only its shards/stages: the inf/nan verdict is all-reduced over the
            # world, so every rank skips the same steps.
            from parallel.scaler import DistributedGradScaler
            scaler = DistributedGradScaler(self.device.type, process_group=dist.group.WORLD)
            # The scale is created lazily by scale(); pipeline ranks without the loss never call
            # it, so create it now on every rank.
            scaler.scale(torch.zeros((), device=self.device))
            return scaler
        return torch.amp.GradScaler(self.device.type)

    # ------------------------------------------------------------------ step

    def autocast(self):
        prec = self.cfg.trainer.precision
        if prec == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[prec])

    def no_sync(self, skip_sync: bool):
        """Context for one micro-batch's backward; skip_sync=True on all but the last micro-batch
        so data-parallel wrappers do not reduce gradients that are still accumulating."""
        return contextlib.nullcontext()

    def micro_batches(self, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        m = self.micro_batch_size
        for i in range(0, x.size(0), m):
            yield x[i:i + m].to(self.device, non_blocking=True), y[i:i + m].to(self.device, non_blocking=True)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)

    def loss_context(self):
        """Around forward AND backward: vocabulary-parallel logits (a DTensor sharded over the
        vocabulary) need loss_parallel() for the cross-entropy and its gradient."""
        if self.cfg.parallel.tp > 1 and self.cfg.parallel.tp_vocab_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return contextlib.nullcontext()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor,
                         scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda l: l) -> torch.Tensor:
        """Forward + backward over this rank's share (B/dp, T); gradients end up averaged over the
        global batch. Returns this rank's mean loss (detached)."""
        if self.pipeline is not None:  # one schedule step over pipeline micro-batches
            with self.autocast(), self.loss_context():
                return self.pipeline.forward_backward(x.to(self.device), y.to(self.device),
                                                      self.loss_fn, scale_loss)
        n = self.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(self.micro_batches(x, y)):
            with self.no_sync(skip_sync=i < n - 1), self.loss_context():
                with self.autocast():
                    loss = self.loss_fn(self.model(xm), ym)
                scale_loss(loss / n).backward()
            total += local_tensor(loss.detach())
        return total / n

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of this rank's share of one validation batch (no gradients)."""
        if self.pipeline is not None:
            with self.autocast(), self.loss_context():
                return self.pipeline.eval_loss(x.to(self.device), y.to(self.device), self.loss_fn)
        total = torch.zeros((), device=self.device)
        n = 0
        for xm, ym in self.micro_batches(x, y):
            with self.autocast(), self.loss_context():
                total += local_tensor(self.loss_fn(self.model(xm), ym)).float()
            n += 1
        return total / n

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping. max_norm=0 only
        measures it. Gradients may mix plain tensors (replicated: counted once) and DTensors on
        different meshes/placements (tp/fsdp shards: their norms are reduced over their mesh);
        under pp every stage adds its share of the squared norm."""
        params = [p for p in {id(p): p for part in self.unwrapped() for p in part.parameters()}.values()
                  if p.grad is not None]
        # A tied weight held by two pipeline ranks is clipped on both but counted once.
        counted = self.pipeline.norm_parameters() if self.pipeline is not None else params
        squared = torch.zeros((), device=self.device)
        for group in _same_layout_groups([p.grad for p in counted if p.grad is not None]):
            norm = torch.nn.utils.get_total_norm(group, 2.0, foreach=None)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            squared += norm.float() ** 2
        if self.pipeline is not None:
            dist.all_reduce(squared, group=self.mesh["pp"].get_group())
        total = squared.sqrt()
        if max_norm > 0:
            for group in _same_layout_groups(params):
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=None)
        return total

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel ranks of a per-rank scalar held by the loss owners; returned on
        every rank (under pp, non-owners contribute zero and receive the result)."""
        if not self.env.distributed:
            return value.detach().float()
        v = value.detach().float().clone() if self.loss_owner else torch.zeros((), device=self.device)
        if self.loss_owner and self.mesh is not None and self.mesh["tp"].size() > 1 \
                and self.mesh["tp"].get_local_rank() != 0:
            v.zero_()  # tp ranks hold the same loss: count it once
        dist.all_reduce(v)
        return v / self.dp_size

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Collective. Every parameter's whole gradient by plain name, on every rank: what parity
        tests compare against one process. Sharded strategies gather their shards."""
        out = {}
        for part in self.unwrapped():
            for name, p in part.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    out[name] = g.detach().float().cpu().clone()
        if self.pipeline is not None:  # each rank holds its stages: merge everyone's
            everyone = [None] * self.env.world_size
            dist.all_gather_object(everyone, out)
            out = {k: v for part in everyone for k, v in part.items()}
        return out

    def after_optimizer_step(self) -> None:
        """Hook after optimizer.step() (e.g. re-tie weights or gather shards). Subclasses that
        override it call super() (the pipeline refreshes a V-shape rank's tied-weight copy)."""
        if self.pipeline is not None:
            self.pipeline.after_optimizer_step()

    # ------------------------------------------------------------------ state

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Model and optimizer state keyed by plain parameter names, in DCP's sharded form: a
        snapshot written by any strategy loads into any other and any world size."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self._state_module(), optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        kernels = [{k: g[k] for k in OPTIMIZER_KERNEL_KEYS if k in g} for g in optimizer.param_groups]
        set_state_dict(self._state_module(), optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        # The snapshot's param groups carry the kernel flags of the strategy that wrote it (fused
        # AdamW for plain tensors); this layout keeps its own (e.g. DTensor params cannot be fused).
        for group, kernel in zip(optimizer.param_groups, kernels):
            group.update(kernel)
        self.after_optimizer_step()

    def _state_module(self) -> nn.Module:
        return self.unwrapped()[0]

    def full_model_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's plain CPU tensors on global rank 0 (None elsewhere): for model.pt."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        if self.pipeline is None:
            sd = get_model_state_dict(self._state_module(),
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return {k: v.detach().cpu().clone() for k, v in sd.items()} if self.env.rank == 0 else None
        # pp: every rank gathers its stages over its dp/tp group (a collective there), then the
        # ranks at dp = tp = 0 (one per stage group, global rank 0 among them) send them to rank 0.
        sd = get_model_state_dict(self._state_module(), options=StateDictOptions(full_state_dict=True))
        sd = {k: v.detach().cpu().clone() for k, v in sd.items()}
        if self.mesh["dp"].get_local_rank() != 0 or self.mesh["tp"].get_local_rank() != 0:
            return None
        parts = [None] * self.cfg.parallel.pp if self.env.rank == 0 else None
        dist.gather_object(sd, parts, dst=0, group=self.mesh["pp"].get_group())
        return {k: v for part in parts for k, v in part.items()} if self.env.rank == 0 else None

    def resident_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank actually holds for parameters, gradients and optimizer state, read from
        the local tensors (a DTensor counts its local shard; a shared tensor counts once)."""
        seen: set[int] = set()

        def nbytes(ts) -> int:
            total = 0
            for t in ts:
                if t is None or not torch.is_tensor(t):
                    continue
                loc = local_tensor(t)
                key = loc.untyped_storage().data_ptr() if loc.numel() else id(loc)
                if key in seen:
                    continue
                seen.add(key)
                total += loc.untyped_storage().nbytes() if loc.numel() else 0
            return total

        params = [p for part in self.unwrapped() for p in part.parameters()]
        out = {"params": nbytes(params)}
        out["grads"] = nbytes([p.grad for p in params])
        out["optimizer"] = nbytes([v for st in optimizer.state.values() for k, v in st.items()
                                   if torch.is_tensor(v) and v.dim() > 0])
        return out


def strategy_class(name: str) -> type[Strategy]:
    """parallel.strategy -> class. Imports lazily so `none` never imports distributed engines."""
    if name == "none":
        return Strategy
    if name == "ddp":
        from parallel.ddp import DDPStrategy
        return DDPStrategy
    if name == "zero":
        from parallel.zero import ZeroStrategy
        return ZeroStrategy
    if name == "fsdp":
        from parallel.fsdp import FSDPStrategy
        return FSDPStrategy
    if name == "dp":
        from parallel.dp import DataParallelStrategy
        return DataParallelStrategy
    raise UsageError(f"unknown parallel.strategy '{name}'")


def build_strategy(cfg: Config, env: DistEnv) -> Strategy:
    """The strategy object for this config and launch, with its device mesh."""
    mesh_shape(cfg, env.world_size)  # clear error before any collective
    mesh = build_mesh(cfg, env)
    return strategy_class(cfg.parallel.strategy)(cfg, env, mesh)
