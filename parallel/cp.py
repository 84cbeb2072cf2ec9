"""Context parallelism: each sequence split over the cp ranks, attention as a causal ring.

Owns the load-balanced split of a sequence (`local_positions`, `shard_sequence`), the ring of cp
ranks (`Ring`: send to the next rank, receive from the previous one), ring attention
(`RingAttention`, a torch.autograd.Function whose forward and backward pass K/V blocks around the
ring), and `ContextParallelLoop`, the StepRunner that feeds each rank its pieces of the sequences.

**The split.** A sequence of T tokens is cut into 2N chunks of c = T / 2N (N = cp). Rank i holds
chunks i and 2N-1-i, in that order. Under a causal mask, query chunk j attends to j+1 key chunks,
so rank i's work is (i+1) + (2N-i) = 2N+1 chunk pairs: the same on every rank (a plain split into
N pieces would give the last rank N times the first's work). Everything but attention works token
by token, so it needs only each token's global position (the learned position embedding:
`GPT.forward(x, positions)`) and the loss over this rank's tokens.

**Ring attention** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the zigzag
split as in zhuzilin/ring-flash-attention and picotron). Every rank keeps its own queries; the K/V
blocks travel: at step s rank r holds the K/V of rank src = (r - s) mod N while it sends them on to
r + 1. With rank r's chunks (r, 2N-1-r) and src's chunks (src, 2N-1-src), the causal mask leaves
exactly one of three cases per step (c x 2c key-query pairs each, so every step costs the same):
    s = 0      (src = r): the local block, causal (positions increase along the local sequence);
    src < r:   all 2c queries see src's first chunk (earlier than both of ours), not its second
               (later than both);
    src > r:   only our second chunk (2N-1-r) sees src's K/V, both of its chunks, in full.
Each block is computed by a fused attention kernel that also returns the log-sum-exp of each
query's scores, lse = log sum_j exp(q.k_j / sqrt(d)). Two partial results over disjoint key sets
merge exactly into the result over their union:
    lse = log(exp(lse1) + exp(lse2)) = logaddexp(lse1, lse2)
    out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2
(each weight is that set's share of the softmax's denominator; both exponents are <= 0, so no
overflow). **Backward** needs, per block, the softmax of the whole row: the kernel's backward
recomputes P = exp(q.k / sqrt(d) - lse) from the lse it is given, and D = rowsum(dout * out) from
the out it is given, so given the merged (global) out and lse it returns exactly that block's share
of dq, dk and dv. dq stays here; dk and dv belong to the block's owner: they travel around the
ring with the block, each holder adding its share, and after N steps the sum arrives at the owner.

Bytes per layer and micro-batch, with K/V of one rank's tokens a = 2 x B x 2c x C x 4 (fp32):
forward N-1 K/V sends of a; backward N-1 K/V sends again plus N dK/dV sends of a (`bytes_sent`).
Under activation checkpointing backward recomputes each block's forward, ring included: another
N-1 K/V sends of a in backward.

**Low precision.** Under bf16/fp16 autocast q, k and v arrive in bf16/fp16 and travel so; each
block's output and log-sum-exp are merged in fp32 and the output rounded once at the end, and
dQ, dK and dV are summed in fp32 (dK/dV travel in fp32) and rounded once, as one fused kernel
rounds once. What still differs from one process: each block's output comes out of the kernel
already rounded to bf16/fp16 before the merge, so a cp run tracks one low-precision process in
the loss (tests/test_tp_pp.py) and not to the fp32 parity bounds.

Kernels: on the CPU torch's fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`,
which returns the lse, and its backward, which takes it); elsewhere the same formulas in plain
matmuls (`math_block` / `math_block_backward`), so the ring runs on every device.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from config import Config
from parallel.collectives import all_gather_single, reduce_scatter
from parallel.step import MicroBatchLoop

# ----------------------------------------------------------------------------- the split


def local_positions(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions of the tokens rank `rank` holds: chunks rank and 2cp-1-rank of 2cp."""
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)]).to(device)


def shard_sequence(t: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of every sequence of `t` (B, T, ...): (B, T / cp, ...)."""
    return t.index_select(1, local_positions(t.size(1), rank, cp, t.device))


# ----------------------------------------------------------------------------- the ring


class Ring:
    """The cp ranks of one sequence: in a ring (each sends to the next and receives from the
    previous: `start_shift`), or all together (`all_gather`, `reduce_scatter`)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """(cp, *t.shape): every rank's t, in cp-rank order."""
        out = t.new_empty((self.size * t.size(0), *t.shape[1:]))  # gloo wants the ranks' tensors along dim 0
        all_gather_single(out, t, group=self.group)
        return out.unflatten(0, (self.size, t.size(0)))

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """t (cp, ...): the sum over the ranks of their t[rank] (a ring's bytes on gloo too)."""
        out = t.new_empty(t.shape[1:])
        reduce_scatter(out, t, self.group)
        return out

    def start_shift(self, tensors: list[torch.Tensor], tag: int) -> Callable[[], list[torch.Tensor]]:
        """Send `tensors` to the next rank and receive the previous rank's, asynchronously (the
        transfer overlaps what runs before the returned wait() is called). `tag` keeps the K/V
        transfers apart from the dK/dV ones in flight beside them."""
        received = [torch.empty_like(t) for t in tensors]
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt, tag=tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, group=self.group, group_peer=prev, tag=tag) for r in received]
        works = dist.batch_isend_irecv(ops)

        def wait() -> list[torch.Tensor]:
            for w in works:
                w.wait()
            return received
        return wait


# ----------------------------------------------------------------------------- one block


def flash_cpu_block(q, k, v, causal: bool):
    """(out, lse) of q over the keys k: torch's fused CPU flash kernel."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def flash_cpu_block_backward(dout, q, k, v, out, lse, causal: bool):
    """(dq, dk, dv) of this block, given the whole row's out and lse."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


def _scores(q, k, causal: bool) -> torch.Tensor:
    """S = Q K^T / sqrt(d), widened to fp32 whatever q's dtype: the matmul runs (and rounds) in q's
    dtype, the softmax's statistics built on it (log-sum-exp, P, dS) are fp32 under bf16 autocast."""
    s = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.size(-1))
    if causal:  # q and k are the same positions (the local block): key j visible to query i iff j <= i
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def math_block(q, k, v, causal: bool):
    """flash_cpu_block in plain matmuls: lse = logsumexp(S), out = exp(S - lse) V."""
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]).to(v.dtype) @ v, lse


def math_block_backward(dout, q, k, v, out, lse, causal: bool):
    """P = exp(S - lse); dV = P^T dO; dS = P (dO V^T - rowsum(dO * O)); dQ = dS K / sqrt(d); dK = dS^T Q / sqrt(d).
    P and dS in fp32, rounded to q's dtype for the matmuls (bf16 autocast: fp32 times bf16 is an error)."""
    p = torch.exp(_scores(q, k, causal) - lse[..., None].float())
    dp = (dout @ v.transpose(-2, -1)).float() - (dout.float() * out.float()).sum(-1, keepdim=True)
    ds, p = (p * dp / math.sqrt(q.size(-1))).to(q.dtype), p.to(dout.dtype)
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout


def kernels(device: torch.device):
    return (flash_cpu_block, flash_cpu_block_backward) if device.type == "cpu" else (math_block, math_block_backward)


def block_of(step: int, rank: int, size: int, c: int) -> tuple[slice, slice, bool]:
    """(local queries, keys of the visiting block, causal) at ring step `step` (see the docstring)."""
    src = (rank - step) % size
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: (out, lse) over their keys and the block's, from each one's softmax."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.copy_(torch.exp(lse - new_lse)[..., None] * out + torch.exp(block_lse - new_lse)[..., None] * block_out)
    lse.copy_(new_lse)


# ----------------------------------------------------------------------------- ring attention

KV_TAG, DKV_TAG = 0, 1


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries (B, H, 2c, D) over every rank's keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        block, _ = kernels(q.device)
        c = q.size(2) // 2
        out, lse, kv = None, None, [k, v]
        for step in range(ring.size):
            incoming = ring.start_shift(kv, KV_TAG) if step < ring.size - 1 else None
            qs, ks, causal = block_of(step, ring.rank, ring.size, c)
            o, l = block(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal)
            if out is None:  # step 0: the local block covers every query
                out, lse = o.float(), l.float()  # merged in fp32, rounded once (as one kernel does)
            else:
                merge(out[:, :, qs], lse[:, :, qs], o.float(), l.float())
            if incoming is not None:
                kv = incoming()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        _, block_backward = kernels(q.device)
        dout, c = dout.contiguous(), q.size(2) // 2
        # dQ, dK and dV summed in fp32 (the dK/dV travel so), rounded once at the end, as one kernel does
        dq, kv, dkv_from_prev = torch.zeros_like(q, dtype=torch.float32), [k, v], None
        for step in range(ring.size):
            incoming = ring.start_shift(kv, KV_TAG) if step < ring.size - 1 else None
            qs, ks, causal = block_of(step, ring.rank, ring.size, c)
            bq, bk, bv = block_backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                        out[:, :, qs], lse[:, :, qs], causal)
            dq[:, :, qs] += bq
            # this block's dK/dV so far: what the ranks it visited before added (none at step 0)
            dk, dv = dkv_from_prev() if dkv_from_prev is not None else (
                torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
            dk[:, :, ks] += bk
            dv[:, :, ks] += bv
            # on with the block to its next holder; after the last step that is its owner
            dkv_from_prev = ring.start_shift([dk, dv], DKV_TAG)
            if incoming is not None:
                kv = incoming()
        dk, dv = dkv_from_prev()  # our own block's, every rank's share added
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def bytes_sent(mode: str, batch: int, local_tokens: int, width: int, cp: int, element_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank sends for one attention layer and micro-batch: K/V of its tokens are
    a = 2 x batch x local_tokens x width x element_bytes (their dtype: 2 under bf16/fp16
    autocast), their gradients g = 2 x batch x local_tokens x width x 4 (dK/dV are summed and
    sent in fp32, rounded once by their owner). ring: forward (cp-1) a, backward (cp-1) a (K/V
    again) + cp g (dK/dV, the last send home). allgather, on a ring algorithm: forward (cp-1) a
    (the all-gather), backward (cp-1) g (the reduce-scatter of dK/dV)."""
    a = 2 * batch * local_tokens * width * element_bytes
    g = 2 * batch * local_tokens * width * 4
    if mode == "allgather":
        return {"forward": (cp - 1) * a, "backward": (cp - 1) * g}
    return {"forward": (cp - 1) * a, "backward": (cp - 1) * a + cp * g}


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    return RingAttention.apply(q, k, v, ring)


# ----------------------------------------------------------------------------- all-gather of K/V


def chunk_blocks(j: int, c: int) -> list[tuple[slice, bool]]:
    """The key blocks of query chunk j over the whole sequence's keys, (keys, causal): its own
    chunk (causal) and, after the first chunk, every earlier position (all visible)."""
    return [(slice(j * c, (j + 1) * c), True)] + ([(slice(0, j * c), False)] if j else [])


class AllGatherAttention(torch.autograd.Function):
    """parallel.cp_mode=allgather (torchtitan's choice): every rank gathers all K/V once, computes
    its two query chunks against them, and in backward reduce-scatters dK/dV to their owners.
    Fewer bytes than the ring ((cp-1) a forward, (cp-1) a backward), but the whole sequence's K/V
    stay in memory per layer until backward (the ring holds its own and one visiting block)."""

    @staticmethod
    def forward(ctx, q, k, v, ranks: Ring):
        block, _ = kernels(q.device)
        n, c = ranks.size, q.size(2) // 2
        # every rank's (k, v), then in sequence order: rank s holds positions local_positions(s)
        gathered = ranks.all_gather(torch.stack([k, v]))  # (cp, 2, B, H, 2c, D)
        order = torch.cat([local_positions(2 * c * n, s, n, q.device) for s in range(n)])
        b, h, _, d = q.shape
        kv = gathered.new_empty((2, b, h, 2 * c * n, d)).index_copy_(3, order, torch.cat(list(gathered), 3))
        q, out = q.contiguous(), torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        for half, j in enumerate((ranks.rank, 2 * n - 1 - ranks.rank)):
            qs = slice(half * c, (half + 1) * c)
            o, l = None, None
            for ks, causal in chunk_blocks(j, c):
                bo, bl = block(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal)
                if o is None:  # merged in fp32, rounded once (as one kernel does)
                    o, l = bo.float(), bl.float()
                else:
                    merge(o, l, bo.float(), bl.float())
            out[:, :, qs], lse[:, :, qs] = o, l
        ctx.save_for_backward(q, kv, out, lse, order)
        ctx.ranks = ranks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, order = ctx.saved_tensors
        ranks = ctx.ranks
        _, block_backward = kernels(q.device)
        n, c, dout = ranks.size, q.size(2) // 2, dout.contiguous()
        # summed in fp32 (and reduce-scattered so), rounded once at the end, as one kernel does
        dq, dkv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(kv, dtype=torch.float32)
        for half, j in enumerate((ranks.rank, 2 * n - 1 - ranks.rank)):
            qs = slice(half * c, (half + 1) * c)
            for ks, causal in chunk_blocks(j, c):
                bq, bk, bv = block_backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                            out[:, :, qs], lse[:, :, qs], causal)
                dq[:, :, qs] += bq
                dkv[0][:, :, ks] += bk
                dkv[1][:, :, ks] += bv
        # back to rank order, (cp, 2, B, H, 2c, D); each owner receives the sum of every rank's share
        per_rank = dkv.index_select(3, order).unflatten(3, (n, 2 * c)).movedim(3, 0).contiguous()
        dk, dv = ranks.reduce_scatter(per_rank)
        return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype), None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranks: Ring) -> torch.Tensor:
    return AllGatherAttention.apply(q, k, v, ranks)


ATTENTION = {"ring": ring_attention, "allgather": allgather_attention}  # parallel.cp_mode


# ----------------------------------------------------------------------------- the runner


def apply_context_parallel(model: nn.Module, ranks: Ring, mode: str) -> None:
    """Every block's attention over the cp `ranks` (model.CausalSelfAttention), by parallel.cp_mode,
    and the position embedding read at the global positions of this rank's tokens (a pipeline
    stage: its blocks; the first stage also its embedding)."""
    attention = ATTENTION[mode]
    cp, rank = ranks.size, ranks.rank
    model.context_parallel_positions = lambda t, device: local_positions(t * cp, rank, cp, device)
    for block in model.blocks.values():
        block.attn.context_parallel = lambda q, k, v: attention(q, k, v, ranks)


def average_grads_over_cp(params: list[nn.Parameter], group: dist.ProcessGroup, cp: int) -> None:
    """Without a data-parallel engine over dp x cp: each cp rank's gradient is that of its own
    tokens' mean loss, and the gradient of the whole mean is their average. One all-reduce of all
    gradients, / cp (a tp shard's cp peers hold the same shard: the local pieces are reduced)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # sum over the cp ranks of their tokens' gradients
    flat /= cp  # each was of a mean over 1/cp of the tokens
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


class ContextParallelLoop(MicroBatchLoop):
    """The micro-batch loop on this rank's tokens of each sequence, at their global positions.

    The loss is the mean over this rank's tokens; every cp rank holds as many, so the mean of the
    cp ranks' losses is the mean over every token of the micro-batch (Strategy.reduce_mean divides
    by dp x cp). The parameters are replicated over cp and each rank's gradient is that of its own
    tokens' mean loss: the gradient of the whole mean is their average over cp. DDP averages over
    the flattened dp x cp group (`Layout.grad_dim`); without a data-parallel engine
    (`reduce_grads`) this runner averages over cp itself: one all-reduce of all gradients, / cp."""

    def __init__(self, gpt: nn.Module, wrapped: nn.Module, cfg: Config, device: torch.device,
                 microbatches: int, cp_mesh: DeviceMesh, reduce_grads: bool):
        super().__init__(gpt, wrapped, cfg, device, microbatches)
        self.cp_group, self.cp, self.cp_rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
        self.reduce_grads = reduce_grads

    def micro_batches(self, x, y):
        for xm, ym in super().micro_batches(x, y):
            yield shard_sequence(xm, self.cp_rank, self.cp), shard_sequence(ym, self.cp_rank, self.cp)

    def forward_backward(self, x, y, scale_loss):
        loss = super().forward_backward(x, y, scale_loss)
        if self.reduce_grads:
            average_grads_over_cp(self.norm_parameters(), self.cp_group, self.cp)
        return loss
