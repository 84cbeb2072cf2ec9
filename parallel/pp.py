"""Pipeline parallelism (parallel.pp): stage split, schedules, tied weights, loss on the last stage.

Owns `split_stages` (this rank's stage modules) and `Pipeline`, the StepRunner (parallel/step.py)
that `parallelize` returns when pp > 1. The stage split, the placement of stages on pp ranks and
the number of micro-batches are the layout's (parallel/layout.py), checked before any process
group exists.

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
(scale_grads=False) so nothing is scaled twice (V-shape schedules hold two stages whose
parameters a per-stage division would hit separately).

Tied embedding / LM head. The first stage's tok_emb.weight and the last stage's lm_head.weight
are two copies of one matrix. After every schedule step their gradients are summed (in one
process the tied weight's gradient is the sum of both uses): an all-reduce in a group made of
the two ranks that hold the ends (for each (dp, cp, tp) coordinate), or a local add when one rank
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

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.nn.parallel import DistributedDataParallel

from config import Config
from model import GPT, lm_loss
from parallel.cp import average_grads_over_cp, shard_sequence
from parallel.dtensor import full_tensor, grad_like_param, local_tensor
from parallel.env import new_group
from parallel.layout import Layout
from parallel.step import StepRunner, autocast, loss_context


def schedule_class(cfg: Config, layout: Layout) -> type[_PipelineSchedule]:
    p = cfg.parallel
    if p.pp_schedule == "gpipe":
        return ScheduleGPipe
    if p.pp_schedule == "1f1b":
        return Schedule1F1B
    if p.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B
    return ScheduleZBVZeroBubble if layout.v_shape else ScheduleInterleavedZeroBubble


def _single_stage(cls: type) -> bool:
    return cls in (ScheduleGPipe, Schedule1F1B)


# ----------------------------------------------------------------------------- stages


def split_stages(model: GPT, layout: Layout, pp_rank: int) -> dict[int, GPT]:
    """This pp rank's stages (stage id -> module), in stage order."""
    return {s: make_stage_module(model, s, layout.stage_blocks) for s in layout.stages_of(pp_rank)}


def make_stage_module(model: GPT, stage: int, counts: tuple[int, ...]) -> GPT:
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


class Stage(PipelineStage):
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


class Pipeline(StepRunner):
    """This rank's pipeline stages, their schedule, and the tied-weight bookkeeping."""

    def __init__(self, stages: dict[int, GPT], wrapped: list[nn.Module], cfg: Config, layout: Layout,
                 mesh: DeviceMesh, device: torch.device, rank: int, reduce_over_cp: bool = False):
        """`stages`: this rank's stage modules by stage id (split_stages, then tensor and context
        parallel); `wrapped`: each of them under the data-parallel engine (DDP, FSDP2 or itself),
        in the same order. The schedule runs the wrapped ones, so DDP's no_sync and FSDP's
        deferred reduce-scatter apply. Under cp each rank feeds the schedule its tokens of every
        sequence (parallel/cp.py), and with no engine over dp x cp (`reduce_over_cp`) averages
        the gradients over cp itself."""
        self.cfg, self.layout, self.device, self.rank = cfg, layout, device, rank
        self.cp_group = mesh["cp"].get_group() if layout.cp_enabled else None
        self.cp_rank = mesh["cp"].get_local_rank() if layout.cp_enabled else 0
        self.reduce_over_cp = reduce_over_cp
        self.stage_ids, self.stage_modules = list(stages), list(stages.values())
        self.holds_first = 0 in stages
        self.holds_last = layout.num_stages - 1 in stages
        self.loss_owner = self.holds_last
        self.tied = cfg.model.tie_weights
        self.tied_group = self._tied_weight_group() if self.tied else None
        self.pp_group = mesh["pp"].get_group()
        # torch PipelineStage objects (benchmarks/pp_bubble.py times them)
        self.stages = [self.make_stage(w, s) for w, s in zip(wrapped, self.stage_ids)]
        cls = schedule_class(cfg, layout)
        self.schedule = cls(self.stages[0] if _single_stage(cls) else self.stages,
                            n_microbatches=layout.microbatches, loss_fn=self._loss, scale_grads=False)
        self._scale_loss = lambda loss: loss
        self._losses: list[torch.Tensor] = []
        super().__init__([self._make_state_view()])

    def make_stage(self, module: nn.Module, stage_id: int) -> PipelineStage:
        """torch's PipelineStage of one of this rank's stages; its input and output shapes are
        inferred at the first step, from a message each stage sends the next."""
        return Stage(module, stage_id, self.layout.num_stages, self.device, group=self.pp_group)

    def _tied_weight_group(self):
        """Process group of the two ranks holding the first and last stage at this rank's
        (dp, cp, tp) coordinate, or None when one rank holds both. Every rank creates every group
        (new_group is collective over the world), in the same order."""
        first, last = self.layout.stage_placement[0], self.layout.stage_placement[-1]
        if first == last:
            return None
        mine = None
        for d in range(self.layout.dp):
            for c in range(self.layout.cp):
                for t in range(self.layout.tp):
                    pair = [self.layout.rank_of(first, d, t, c), self.layout.rank_of(last, d, t, c)]
                    group = new_group(ranks=pair)
                    if self.rank in pair:
                        mine = group
        return mine

    def _first(self) -> GPT:
        return self.stage_modules[self.stage_ids.index(0)]

    def _last(self) -> GPT:
        return self.stage_modules[self.stage_ids.index(self.layout.num_stages - 1)]

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
        loss = lm_loss(logits, targets)
        self._losses.append(local_tensor(loss.detach()).float())
        return self._scale_loss(loss / self.layout.microbatches)

    def _run(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> torch.Tensor:
        self._losses = []
        if self.layout.cp_enabled:  # this rank's tokens of every sequence (the stages know their positions)
            x, y = (shard_sequence(t, self.cp_rank, self.layout.cp) for t in (x, y))
        args = (x.to(self.device),) if self.holds_first else ()
        target = y.to(self.device) if self.holds_last else None
        with autocast(self.cfg, self.device), loss_context(self.cfg):
            if train:
                self.schedule.step(*args, target=target, return_outputs=False)
            else:
                self.schedule.eval(*args, target=target)
        if not self.holds_last:
            return torch.zeros((), device=self.device)
        # The last M calls are the micro-batches (the first step's shape inference adds one).
        return torch.stack(self._losses[-self.layout.microbatches:]).mean()

    def forward_backward(self, x, y, scale_loss):
        """One schedule step over this rank's share; returns the mean loss on the last stage's
        rank (zero elsewhere: Strategy.reduce_mean knows the loss owners)."""
        self._scale_loss = scale_loss
        loss = self._run(x, y, train=True)
        if self.reduce_over_cp:  # every parameter this rank holds, the tied head's copy included
            held = {id(q): q for m in self.stage_modules for q in m.parameters()}
            average_grads_over_cp(list(held.values()), self.cp_group, self.layout.cp)
        self.sync_tied_grads()
        return loss

    @torch.no_grad()
    def eval_loss(self, x, y):
        self._scale_loss = lambda loss: loss
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
                local_tensor(grad_like_param(first)).add_(local_tensor(grad_like_param(last)))
                last.grad = None  # not in the optimizer: refreshed in after_optimizer_step
        elif self.tied_group is not None and (self.holds_first or self.holds_last):
            weight = self._first().tok_emb.weight if self.holds_first else self._last().lm_head.weight
            dist.all_reduce(local_tensor(grad_like_param(weight)), group=self.tied_group)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """V-shape: copy the optimizer-owned first copy into the last stage's copy."""
        if self.tied and self.holds_first and self.holds_last:
            first, last = self._first().tok_emb.weight, self._last().lm_head.weight
            if last is not first:
                local_tensor(last).copy_(local_tensor(first))

    # ------------------------------------------------------------------ across stages

    def norm_parameters(self) -> list[nn.Parameter]:
        """The state view's parameters, minus the tied weight where the first stage's rank
        already counts it."""
        params = super().norm_parameters()
        if self.tied and self.holds_last and not self.holds_first:
            tied = self._last().lm_head.weight
            params = [p for p in params if p is not tied]
        return params

    def held_modules(self) -> list[nn.Module]:
        """The stage modules, not the state view: on a V-shape rank the view's tied head is an
        alias of the embedding, while the last stage holds a copy of its own."""
        return self.stage_modules

    def sum_over_stages(self, value: torch.Tensor) -> None:
        dist.all_reduce(value, group=self.pp_group)

    def merge_over_stages(self, per_rank: dict) -> dict:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, per_rank)
        return {k: v for part in everyone for k, v in part.items()}

    def full_model_state_dict(self, rank):
        """Every rank gathers its stages over its dp/tp group (a collective there), then the ranks
        at dp = cp = tp = 0 (one per stage group, global rank 0 among them) send them to rank 0."""
        sd = get_model_state_dict(self.parts[0], options=StateDictOptions(full_state_dict=True))
        sd = {k: v.detach().cpu().clone() for k, v in sd.items()}
        at = self.layout.coordinate(rank)
        if at.dp != 0 or at.tp != 0 or at.cp != 0:  # cp peers hold the same parameters
            return None
        parts = [None] * self.layout.pp if rank == 0 else None
        dist.gather_object(sd, parts, dst=0, group=self.pp_group)
        return {k: v for part in parts for k, v in part.items()} if rank == 0 else None

    def full_tensors(self, rank, names):
        """Each tensor is gathered over the dp/tp group of a stage that holds it, and the rank at
        dp = cp = tp = 0 there (the first such stage, in rank order) sends it to rank 0: stages hold
        different tensors, so rank 0 receives them one by one in `names` order. The stages' names
        are exchanged first (a list of strings per rank)."""
        sd = get_model_state_dict(self.parts[0])
        at = self.layout.coordinate(rank)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(sd) if at.dp == at.tp == at.cp == 0 else [])
        sender = {}
        for r, held in enumerate(everyone):
            for name in held:
                sender.setdefault(name, r)
        for name in names:
            whole = full_tensor(sd[name].detach()) if name in sd else None  # collective in this stage's group
            if rank == sender[name] != 0:
                dist.send(whole.contiguous(), dst=0)
            elif rank == 0 and sender[name] != 0:
                whole = torch.empty(names[name].shape, dtype=names[name].dtype, device=self.device)
                dist.recv(whole, src=sender[name])
            yield name, (whole.cpu() if rank == 0 else None)
            del whole
