"""How this rank runs the forward and backward passes of one optimizer step.

`StepRunner` is the interface; `parallelize` picks one of two implementations:

- `MicroBatchLoop` (here): the whole model lives on this rank. The rank's share of the batch is
  cut into micro-batches whose gradients accumulate; the data-parallel engine's gradient sync is
  skipped on all but the last (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)`),
  so gradients are reduced once per optimizer step.
- `parallel.pp.Pipeline`: this rank holds pipeline stages; one schedule step of
  torch.distributed.pipelining runs all micro-batches, the loss exists on the last stage only.

The data-parallel strategy (parallel/strategy.py) asks the runner for what differs between the
two: the loss, which parameters this rank counts in the global gradient norm, how per-rank
results combine across stages, and the whole model's weights.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from config import Config
from model import lm_loss
from parallel.dtensor import full_tensor, local_tensor
from parallel.env import DTYPES
from parallel.zero_shard import ZeroDataParallel

ScaleLoss = Callable[[torch.Tensor], torch.Tensor]


def autocast(cfg: Config, device: torch.device):
    """Mixed precision of forward (and the loss): bf16/fp16 autocast, or nothing for fp32."""
    prec = cfg.trainer.precision
    if prec == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[prec])


def loss_context(cfg: Config):
    """Around forward AND backward: vocabulary-parallel logits (a DTensor sharded over the
    vocabulary) need loss_parallel() for the cross-entropy and its gradient."""
    if cfg.parallel.tp > 1 and cfg.parallel.tp_vocab_parallel:
        return loss_parallel()
    return contextlib.nullcontext()


def gradient_sync(module: nn.Module, sync: bool):
    """Context for one micro-batch's backward: with sync=False the data-parallel engine keeps
    the gradients local (they are still accumulating)."""
    if isinstance(module, DistributedDataParallel) and not sync:
        return module.no_sync()
    if isinstance(module, (FSDPModule, ZeroDataParallel)):  # no no_sync(): a flag read by the next backward
        module.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


class StepRunner(ABC):
    """One optimizer step's forward/backward on this rank, and what depends on how the model is
    split over pipeline stages."""

    # Does this rank compute the loss? (pipeline: the last stage's ranks only)
    loss_owner = True
    # The module that maps ids -> logits on this rank (None under a pipeline: no rank has one).
    model: nn.Module | None = None

    def __init__(self, parts: list[nn.Module]):
        # GPT-shaped modules with plain parameter names ("blocks.3.attn.q_proj.weight"):
        # optimizer groups, clipping, gradients and DCP state see these.
        self.parts = parts

    @abstractmethod
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, scale_loss: ScaleLoss) -> torch.Tensor:
        """Gradients of the mean loss over this rank's share (B/dp, T); returns that loss."""

    @abstractmethod
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's mean loss over its share of a validation batch (no gradients)."""

    def held_modules(self) -> list[nn.Module]:
        """The modules whose tensors this rank holds in memory (Strategy.resident_bytes)."""
        return self.parts

    def norm_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients this rank counts in the global gradient norm."""
        return list({id(p): p for part in self.parts for p in part.parameters()}.values())

    def sum_over_stages(self, value: torch.Tensor) -> None:
        """Collective under a pipeline: in place, the sum of every stage's per-rank `value`."""

    def merge_over_stages(self, per_rank: dict) -> dict:
        """Collective under a pipeline: every rank's dict (each holds its stages' keys) merged."""
        return per_rank

    def after_optimizer_step(self) -> None:
        """Anything the split needs after an update (a pipeline re-syncs a tied weight's copy)."""

    @abstractmethod
    def full_model_state_dict(self, rank: int) -> dict[str, torch.Tensor] | None:
        """Collective. The whole model's plain CPU tensors on global rank 0 (None elsewhere)."""

    @abstractmethod
    def full_tensors(self, rank: int, names: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Collective, one tensor at a time: (name, its whole value as a CPU tensor on global rank 0,
        None elsewhere) for each of `names` in order (name -> a meta tensor of its shape and dtype). Every rank iterates it to the end; no rank holds
        more than one whole tensor at a time (model.pt at the end of a run)."""


class MicroBatchLoop(StepRunner):
    """The whole model on this rank; gradient accumulation over `microbatches` micro-batches."""

    def __init__(self, gpt: nn.Module, wrapped: nn.Module, cfg: Config, device: torch.device, microbatches: int):
        """`gpt`: the GPT with its plain names; `wrapped`: it under the data-parallel engine
        (DDP, FSDP2, nn.DataParallel or itself): what runs forward."""
        super().__init__([gpt])
        self.wrapped, self.model, self.cfg, self.device = wrapped, wrapped, cfg, device
        self.microbatches = microbatches

    def micro_batches(self, x: torch.Tensor, y: torch.Tensor):
        m = x.size(0) // self.microbatches
        for i in range(0, x.size(0), m):
            yield x[i:i + m].to(self.device, non_blocking=True), y[i:i + m].to(self.device, non_blocking=True)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """One micro-batch's forward (context parallelism adds the tokens' positions: parallel/cp.py)."""
        return self.model(x)

    def forward_backward(self, x, y, scale_loss):
        n = self.microbatches
        total = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(self.micro_batches(x, y)):
            with gradient_sync(self.wrapped, sync=i == n - 1), loss_context(self.cfg):
                with autocast(self.cfg, self.device):
                    loss = lm_loss(self.logits(xm), ym)
                scale_loss(loss / n).backward()
            total += local_tensor(loss.detach())
        return total / n

    @torch.no_grad()
    def eval_loss(self, x, y):
        total = torch.zeros((), device=self.device)
        for xm, ym in self.micro_batches(x, y):
            with autocast(self.cfg, self.device), loss_context(self.cfg):
                total += local_tensor(lm_loss(self.logits(xm), ym)).float()
        return total / self.microbatches

    def full_model_state_dict(self, rank):
        sd = get_model_state_dict(self.parts[0], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().cpu().clone() for k, v in sd.items()} if rank == 0 else None

    def full_tensors(self, rank, names):
        # Not full_state_dict=True: that gathers every tensor before returning any. Here each
        # sharded parameter (FSDP2, zero-3, HSDP, tp: a DTensor) is gathered on its own, written
        # by the caller and dropped before the next; a replica (ddp, ZeRO-1/2) is read as it is.
        sd = get_model_state_dict(self.parts[0])
        for name in names:
            whole = full_tensor(sd[name].detach())  # collective over the parameter's mesh
            yield name, (whole.cpu() if rank == 0 else None)
            del whole
