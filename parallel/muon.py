"""`optimizer.name=muon`: torch's Muon for the blocks' weight matrices, AdamW for the rest.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) replaces each hidden
matrix's update by the orthogonalised momentum (5 Newton-Schulz iterations), the update of the
modded-nanogpt speedruns. Embeddings, the (tied) head, biases and LayerNorms are not hidden
matrices and stay on AdamW, as there. The Muon learning rate is scaled per matrix to AdamW's update
RMS (`adjust_lr_fn="match_rms_adamw"`, 0.2 sqrt(max(rows, cols)): Liu et al. 2025, "Muon is
Scalable for LLM Training", https://arxiv.org/abs/2502.16982), so `optimizer.lr`,
`optimizer.weight_decay` and the schedule mean the same for both parts.

Newton-Schulz works on whole matrices: orthogonalising a shard is not orthogonalising the matrix.
Where a rank holds a matrix whole (ddp, dp, none, pipeline stages) it steps it as it is. A matrix
held as a DTensor (FSDP2's rows, tensor parallelism's shards, both on a 2-D mesh) is gathered
whole (`full_tensor`: an all-gather of its momentum-updated gradient over the matrix's mesh),
orthogonalised on every rank alike, and each rank keeps its own shard of the update: the same
step as one process, for one all-gather of the matrix per step and every rank computing every
matrix's iterations (the simple way: spreading the matrices over the ranks would divide that
work only if the ranks computed their shares at the same time; one owner per matrix broadcasting
its result before the next matrix measured 11% slower: docs/performance.md). ZeRO-1/2's flat
slices of plain tensors are refused at configuration (parallel/options.py).

`MuonWithAdamW` is one `torch.optim.Optimizer` (one `param_groups`, one `state`) so the LR
scheduler, gradient clipping, DCP's optimizer state dict and snapshots treat it like AdamW: its
groups are shared with an inner `torch.optim.Muon` and `torch.optim.AdamW`, which step their own
groups and keep their state in this optimizer's `state` (the parameters are disjoint).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

MUON_MODULES = ("q_proj", "k_proj", "v_proj", "out_proj", "fc", "proj")  # model.py's Linear layers in a block


def muon_parameter_ids(parts: list[nn.Module]) -> set[int]:
    """The blocks' Linear weights (2-D hidden matrices) of these GPT parts."""
    out = set()
    for part in parts:
        for name, p in part.named_parameters():
            pieces = name.split(".")
            if pieces[0] == "blocks" and pieces[-1] == "weight" and pieces[-2] in MUON_MODULES and p.requires_grad:
                out.add(id(p))
    return out


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration (torch.optim._muon._zeropower_via_newtonschulz's
    math): x <- a x + (b X + c X^2) x with X = x x^T, on the wide orientation, in `dtype`."""
    x = g.to(dtype)
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x if wide else x.T).to(g.dtype)


def orthogonalize_whole(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                        eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`orthogonalize` of the whole matrix; a DTensor's is gathered first (collective over its
    mesh), and the result is laid out as `update` was (Replicate -> Shard is a local slice)."""
    if not isinstance(update, DTensor):
        return orthogonalize(update, coefficients, steps, eps, dtype)
    whole = orthogonalize(update.full_tensor(), coefficients, steps, eps, dtype)
    replicated = DTensor.from_local(whole, update.device_mesh, [Replicate()] * update.device_mesh.ndim,
                                    run_check=False)
    return replicated.redistribute(update.device_mesh, update.placements)


def lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch's Muon learning-rate adjustment of a (rows, cols) matrix: "match_rms_adamw" 0.2
    sqrt(max(rows, cols)) (AdamW's update RMS), else ("original") sqrt(max(1, rows / cols))."""
    rows, cols = shape[:2]
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else math.sqrt(max(1, rows / cols))


class Muon(torch.optim.Muon):
    """torch's Muon, with the Newton-Schulz iterations in fp32 on a CPU. torch 2.13 runs them in
    bf16 everywhere; a CPU without bf16 instructions emulates that: nanoGPT's CPU model at batch
    16 took 1,026 ms per step instead of about 100 (measured on the 2-core machine, AVX2 only). On
    a GPU the iterations stay in bf16, as in torch. The update is torch's `_single_tensor_muon`."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            lr, momentum = float(group["lr"]), group["momentum"]
            for p, g, buf in zip(params, grads, buffers):
                buf.lerp_(g, 1 - momentum)
                update = g.lerp(buf, momentum) if group["nesterov"] else buf
                dtype = torch.float32 if p.device.type == "cpu" else torch.bfloat16
                update = orthogonalize_whole(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * lr_ratio(group["adjust_lr_fn"], p.shape))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over `muon_groups`, AdamW over `adamw_groups` (lists of param-group dicts)."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], lr: float,
                 adamw: Callable[[list[dict]], torch.optim.Optimizer], momentum: float = 0.95):
        """`adamw` builds the AdamW part from its groups (Strategy.adamw: the configured betas and
        the same fused kernel choice as without Muon)."""
        muon_groups = [dict(g, use_muon=True) for g in muon_groups if g["params"]]
        adamw_groups = [dict(g, use_muon=False) for g in adamw_groups if g["params"]]
        super().__init__(muon_groups + adamw_groups, {"lr": lr})
        muon, adamw_part = self.param_groups[:len(muon_groups)], self.param_groups[len(muon_groups):]
        self._muon = Muon(muon, lr=lr, momentum=momentum, adjust_lr_fn="match_rms_adamw") if muon else None
        self._adamw = adamw(adamw_part)
        self._link()

    def _link(self) -> None:
        """The inner optimizers step this optimizer's own group dicts and keep their state in its
        `state` (the two parameter sets are disjoint): what the scheduler sets and a snapshot
        loads is what they use."""
        muon = [g for g in self.param_groups if g["use_muon"]]
        if self._muon is not None:
            self._muon.param_groups, self._muon.state = muon, self.state
        self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces param_groups and state with new objects
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._muon is not None:
            self._muon.step()
        self._adamw.step()
        return loss
