"""Pipeline parallelism (parallel.pp): stage split, schedules, tied weights, loss on the last stage.

Owns `Pipeline`, which the base Strategy delegates to when pp > 1, and the layout rules that can
be checked before any process group exists (`stage_block_counts`, `stage_to_pp_rank`,
`pipeline_microbatches`, `last_stage_pp_rank`).

Split. The model's blocks are cut into S = pp * pp_stages_per_rank stages (even split, or
`parallel.pp_split="3,1"`). Each stage is a deep copy of the whole GPT with everything it does
not own set to None (model.py allows it), so parameter names stay those of the whole model
("blocks.3.attn.q_proj.weight"): the first stage owns tok_emb/pos_emb/drop, the last ln_f and
lm_head. Stage s lives on pp rank s % pp ("loop" placement: gpipe, 1f1b, interleaved_1f1b,
looped zero-bubble), or on a V ("v" placement: rank r holds stages r and S-1-r) for the ZB-V
schedule (zero_bubble with 2 stages per rank).

Schedules come from torch.distributed.pipelining with manual `PipelineStage`s:
    gpipe             ScheduleGPipe                  all forwards, then all backwards
    1f1b              Schedule1F1B                   one forward, one backward in steady state
    interleaved_1f1b  ScheduleInterleaved1F1B        v >= 2 stages per rank (looped placement)
    zero_bubble       ScheduleZBVZeroBubble (v = 2)  backward split into input- and weight-
                      ScheduleInterleavedZeroBubble  gradients; weight work fills the bubble
Bubble fraction of gpipe/1f1b with p stages and m micro-batches: (p-1)/(m+p-1) of the step.

Micro-batches and loss scaling. One optimizer step runs ONE schedule step over the rank's share
of the batch (B / dp sequences), cut into M = parallel.microbatches pipeline micro-batches
(0 = per-rank batch / trainer.micro_batch_size when that is set, else pp). The loss handed to
the schedule is scale_loss(mean_loss_of_microbatch / M): gradients are then the gradients of the
mean loss over the rank's share (the single-process definition), the fp16 GradScaler scale
reaches every micro-batch's backward, and the schedule's own division by M is off
(scale_grads=False) so nothing is scaled twice (trap 8: V-shape schedules hold two stages whose
parameters a per-stage division would hit separately).

Tied embedding / LM head. The first stage's tok_emb.weight and the last stage's lm_head.weight
are two copies of one matrix. After every schedule step their gradients are summed (in one
process the tied weight's gradient is the sum of both uses): an all-reduce in a group made of
the two ranks that hold the ends (for each (dp, tp) coordinate), or a local add when one rank
holds both (V-shape). Both copies then get the same update and stay equal; on a V-shape rank the
last stage's copy is left out of the optimizer and refreshed from the first after each step.

State. `state_view` is a GPT-shaped module that holds this rank's stages under their plain names
(blocks of all local stages, embeddings/head where held) and the tied weight under BOTH names,
as a one-process GPT has it. DCP state dicts of it look like a one-process model restricted to
this rank's keys, so snapshots reshard across pp, tp and dp layouts.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.nn.parallel import DistributedDataParallel

from config import Config, UsageError
from model import GPT
from parallel import local_tensor

# ----------------------------------------------------------------------------- layout rules


def num_stages(cfg: Config) -> int:
    return cfg.parallel.pp * cfg.parallel.pp_stages_per_rank


def stage_block_counts(cfg: Config) -> list[int]:
    """Blocks per stage: parallel.pp_split, or an even split (config.validate checked both)."""
    p, s = cfg.parallel, num_stages(cfg)
    if p.pp_split:
        return [int(v) for v in p.pp_split.split(",")]
    return [cfg.model.n_layer // s] * s


def is_v_shape(cfg: Config) -> bool:
    """ZB-V: two stages per rank placed on a V (rank r holds stages r and S-1-r)."""
    p = cfg.parallel
    return p.pp_schedule == "zero_bubble" and p.pp_stages_per_rank == 2


def stage_to_pp_rank(cfg: Config) -> dict[int, int]:
    return generate_stage_to_rank_mapping(cfg.parallel.pp, num_stages(cfg),
                                          style="v" if is_v_shape(cfg) else "loop")


def last_stage_pp_rank(cfg: Config) -> int:
    return stage_to_pp_rank(cfg)[num_stages(cfg) - 1]


def pipeline_microbatches(cfg: Config, per_rank_batch: int) -> int:
    """Pipeline micro-batches per optimizer step for this per-rank batch, or a UsageError."""
    p, t = cfg.parallel, cfg.trainer
    m = p.microbatches or (max(1, per_rank_batch // t.micro_batch_size) if t.micro_batch_size else p.pp)
    if per_rank_batch % m:
        raise UsageError(f"the per-rank batch {per_rank_batch} (= trainer.batch_size / dp) does not split "
                         f"into {m} pipeline micro-batches; make trainer.batch_size a multiple of "
                         f"{m} x dp or change parallel.microbatches")
    if t.micro_batch_size and t.micro_batch_size * m != per_rank_batch:
        raise UsageError(f"trainer.micro_batch_size={t.micro_batch_size} x parallel.microbatches={m} != "
                         f"per-rank batch {per_rank_batch}: under pp one optimizer step is one pipeline "
                         f"schedule; set trainer.micro_batch_size=0 or {per_rank_batch // m}")
    if p.pp_schedule != "gpipe" and m < p.pp:
        raise UsageError(f"parallel.pp_schedule={p.pp_schedule} needs parallel.microbatches >= pp = {p.pp} "
                         f"(got {m}); raise parallel.microbatches or use gpipe")
    rounds = max(1, m // p.pp)
    if p.pp_stages_per_rank > 1 and m % rounds:
        raise UsageError(f"parallel.pp_schedule={p.pp_schedule} with {p.pp_stages_per_rank} stages per "
                         f"rank runs micro-batches in rounds of pp: parallel.microbatches={m} must be "
                         f"a multiple of {rounds}; use a multiple of pp={p.pp}")
    return m


def schedule_class(cfg: Config) -> type[_PipelineSchedule]:
    p = cfg.parallel
    if p.pp_schedule == "gpipe":
        return ScheduleGPipe
    if p.pp_schedule == "1f1b":
        return Schedule1F1B
    if p.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B
    return ScheduleZBVZeroBubble if is_v_shape(cfg) else ScheduleInterleavedZeroBubble


def _single_stage(cls: type) -> bool:
    return cls in (ScheduleGPipe, Schedule1F1B)


# ----------------------------------------------------------------------------- stages


def make_stage_module(model: GPT, stage: int, counts: list[int]) -> GPT:
    """A deep copy of `model` keeping only stage `stage`'s pieces (same parameter names)."""
    first_block = sum(counts[:stage])
    keep = {str(i) for i in range(first_block, first_block + counts[stage])}
    part = copy.deepcopy(model)
    for name in list(part.blocks.keys()):
        if name not in keep:
            del part.blocks[name]
    if stage != 0:
        part.tok_emb = part.pos_emb = part.drop = None
    if stage != len(counts) - 1:
        part.ln_f = part.lm_head = None
    return part


class _Stage(PipelineStage):
    """PipelineStage with two workarounds for torch 2.13, both measured."""

    # 1. The first step's shape inference calls the module directly (not through the stage's
    # no_sync path): a DDP-wrapped stage would arm its reducer for a backward that never
    # reaches the parameters, then count every parameter twice when it rebuilds its buckets
    # (an internal assert in reducer.cpp at the next step). Run it under no_sync().
    def _compute_outputs(self, *args, module: nn.Module, **kwargs):
        sync_off = module.no_sync() if isinstance(module, DistributedDataParallel) else contextlib.nullcontext()
        with sync_off:
            return module(*args, **kwargs)

    # 2. schedule.eval() on a V-shape schedule still walks its backward actions, and the hand-off
    # of input gradients between two stages of one rank asserts that there is a backward. In a
    # forward-only pass there is nothing to hand off.
    def get_local_bwd_output(self, mb_index: int):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


class _Alias(nn.Module):
    """Holds a parameter that lives in another module under a second name (the tied weight)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


def _grad_as_param(p: nn.Parameter) -> torch.Tensor:
    """p.grad laid out like p. A DTensor gradient may come back in another placement than its
    parameter (a vocabulary-parallel embedding's gradient is Replicate while the weight is
    Shard(0)); the two tied copies must agree element for element before they are summed."""
    g = p.grad
    if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g


class Pipeline:
    """This rank's pipeline stages, their schedule, and the tied-weight bookkeeping."""

    def __init__(self, model: GPT, cfg: Config, mesh, device: torch.device, per_rank_batch: int):
        self.cfg = cfg
        self.device = device
        self.pp_mesh = mesh["pp"]
        self.pp_rank = self.pp_mesh.get_local_rank()
        self.num_stages = num_stages(cfg)
        self.microbatches = pipeline_microbatches(cfg, per_rank_batch)
        placement = stage_to_pp_rank(cfg)
        self.stage_ids = [s for s in range(self.num_stages) if placement[s] == self.pp_rank]
        counts = stage_block_counts(cfg)
        # Stage modules in stage order; the Strategy shards/wraps them, then calls build_schedule.
        self.stage_modules: list[GPT] = [make_stage_module(model, s, counts) for s in self.stage_ids]
        self.holds_first = 0 in self.stage_ids
        self.holds_last = self.num_stages - 1 in self.stage_ids
        self.tied = cfg.model.tie_weights
        self.tied_group = self._tied_weight_group(mesh, placement) if self.tied else None
        self.stages: list[PipelineStage] = []
        self.schedule: _PipelineSchedule | None = None
        self.state_view: nn.Module | None = None
        self._loss_fn: Callable | None = None
        self._scale_loss: Callable = lambda loss: loss
        self._losses: list[torch.Tensor] = []

    def _tied_weight_group(self, mesh, placement: dict[int, int]):
        """Process group of the two ranks holding the first and last stage at this rank's
        (dp, tp) coordinate, or None when one rank holds both. Every rank creates every group
        (new_group is collective over the world), in the same order."""
        first, last = placement[0], placement[self.num_stages - 1]
        if first == last:
            return None
        ranks = mesh.mesh  # (pp, dp, tp) tensor of global ranks
        mine = None
        for d in range(ranks.size(1)):
            for t in range(ranks.size(2)):
                pair = [int(ranks[first, d, t]), int(ranks[last, d, t])]
                group = dist.new_group(pair)
                if dist.get_rank() in pair:
                    mine = group
        return mine

    # ------------------------------------------------------------------ build

    def _first(self) -> GPT:
        return self.stage_modules[self.stage_ids.index(0)]

    def _last(self) -> GPT:
        return self.stage_modules[self.stage_ids.index(self.num_stages - 1)]

    def build_schedule(self, wrapped: list[nn.Module]) -> None:
        """`wrapped[i]` is stage_modules[i] after data-parallel wrapping (DDP/FSDP or itself):
        the schedule runs those, so DDP's no_sync and FSDP's deferred reduce-scatter apply."""
        group = self.pp_mesh.get_group()
        stages = [_Stage(w, s, self.num_stages, self.device, group=group)
                  for w, s in zip(wrapped, self.stage_ids)]
        self.stages = stages  # torch PipelineStage objects (benchmarks/pp_bubble.py times them)
        cls = schedule_class(self.cfg)
        target = stages[0] if _single_stage(cls) else stages
        self.schedule = cls(target, n_microbatches=self.microbatches, loss_fn=self._loss,
                            scale_grads=False)
        self.state_view = self._make_state_view()

    def _make_state_view(self) -> nn.Module:
        """GPT-shaped module over this rank's pieces (see the module docstring). Built after
        sharding/wrapping, which replace parameter objects."""
        view = nn.Module()
        first = self._first() if self.holds_first else None
        last = self._last() if self.holds_last else None
        # Registration order = GPT's, so the tied weight's first name is tok_emb.weight.
        if first is not None:
            view.tok_emb, view.pos_emb, view.drop = first.tok_emb, first.pos_emb, first.drop
        elif self.tied and last is not None:
            view.tok_emb = _Alias(last.lm_head.weight)
        blocks = {k: b for m in self.stage_modules for k, b in m.blocks.items()}
        view.blocks = nn.ModuleDict({k: blocks[k] for k in sorted(blocks, key=int)})
        if last is not None:
            view.ln_f = last.ln_f
            # V-shape: the optimizer owns the first copy; the last is refreshed from it.
            view.lm_head = _Alias(first.tok_emb.weight) if (self.tied and first is not None) else last.lm_head
        elif self.tied and first is not None:
            view.lm_head = _Alias(first.tok_emb.weight)
        return view

    # ------------------------------------------------------------------ step

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Called by the schedule on the last stage for every micro-batch."""
        loss = self._loss_fn(logits, targets)
        self._losses.append(local_tensor(loss.detach()).float())
        return self._scale_loss(loss / self.microbatches)

    def _run(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> torch.Tensor:
        self._losses = []
        args = (x,) if self.holds_first else ()
        target = y if self.holds_last else None
        if train:
            self.schedule.step(*args, target=target, return_outputs=False)
        else:
            self.schedule.eval(*args, target=target)
        if not self.holds_last:
            return torch.zeros((), device=self.device)
        # The last M calls are the micro-batches (the first step's shape inference adds one).
        return torch.stack(self._losses[-self.microbatches:]).mean()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                         scale_loss: Callable) -> torch.Tensor:
        """One schedule step over this rank's share; returns the mean loss on the last stage's
        rank (zero elsewhere: Strategy.reduce_mean knows the loss owners)."""
        self._loss_fn, self._scale_loss = loss_fn, scale_loss
        loss = self._run(x, y, train=True)
        self.sync_tied_grads()
        return loss

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        self._loss_fn, self._scale_loss = loss_fn, (lambda loss: loss)
        return self._run(x, y, train=False)

    # ------------------------------------------------------------------ tied weight

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """tok_emb and lm_head copies: both get the sum of their gradients."""
        if not self.tied:
            return
        if self.holds_first and self.holds_last:
            first, last = self._first().tok_emb.weight, self._last().lm_head.weight
            if last is not first and last.grad is not None:
                local_tensor(_grad_as_param(first)).add_(local_tensor(_grad_as_param(last)))
                last.grad = None  # not in the optimizer: refreshed in after_optimizer_step
        elif self.tied_group is not None and (self.holds_first or self.holds_last):
            weight = self._first().tok_emb.weight if self.holds_first else self._last().lm_head.weight
            dist.all_reduce(local_tensor(_grad_as_param(weight)), group=self.tied_group)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """V-shape: copy the optimizer-owned first copy into the last stage's copy."""
        if self.tied and self.holds_first and self.holds_last:
            first, last = self._first().tok_emb.weight, self._last().lm_head.weight
            if last is not first:
                local_tensor(last).copy_(local_tensor(first))

    def norm_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients count in the global norm on this rank: the state view's,
        minus the tied weight where the first stage's rank already counts it."""
        params = list(self.state_view.parameters())
        if self.tied and self.holds_last and not self.holds_first:
            tied = self._last().lm_head.weight
            params = [p for p in params if p is not tied]
        return params
