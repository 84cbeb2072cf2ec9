"""Activations: the bytes autograd saves for backward, per block, per pipeline stage and per
rank with its micro-batches in flight, and the transients live at the peak beside them.

The per-block count is read off a measurement of THIS model's forward with
torch.autograd.graph.saved_tensors_hooks (tests/test_planner.py compares to the byte). It is
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1:
sbh(34 + 5as/h) bytes in 16-bit) adapted: SDPA's fused kernel keeps q, k, v, its output and a
logsumexp instead of the 5as^2b attention matrices, and each term carries the dtype it really has
(`block_activation_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass

from config import Config
from model import GPTConfig
from parallel.options import Engine
from planner.records import PlannedLayout
from planner.units import ceil_div


@dataclass
class ActivationModel:
    """Bytes per element of each kind of saved tensor, for one precision setting."""
    matmul: int  # outputs of Linear layers and attention (autocast: 16-bit)
    residual: int  # the residual stream and LayerNorm inputs (fp32 under autocast)
    casts: bool  # autocast: every Linear saves its own 16-bit copy of its input and weight
    cpu_masks: bool  # dropout masks: CUDA's are bool, CPU's have the dtype of what is dropped
    fused_attention: bool  # SDPA flash/efficient kernel (no s x s matrices saved)


def activation_model(cfg: Config, engine: Engine) -> ActivationModel:
    """The dtypes of what is saved: autocast (trainer.precision) runs Linear layers in 16-bit;
    FSDP2's mixed_precision casts the parameters, and so every activation, to 16-bit."""
    autocast = cfg.trainer.precision != "fp32"
    fsdp_mp = engine is Engine.FSDP and cfg.parallel.mixed_precision != "none"
    cpu = cfg.trainer.device == "cpu"
    matmul = 2 if (autocast or fsdp_mp) else 4
    residual = 2 if (fsdp_mp and not autocast) else 4
    # Measured (torch 2.13): on CPU, SDPA with dropout falls back to the math kernel and dropout
    # saves its scaled mask in the activation dtype; CUDA's flash/efficient kernels take dropout
    # (saving only an RNG offset) and native_dropout saves a bool mask.
    fused = not (cpu and cfg.model.dropout > 0)
    return ActivationModel(matmul, residual, autocast, cpu, fused)


def block_activation_bytes(g: GPTConfig, am: ActivationModel, b: int, tp: int, sp: bool,
                           checkpointed: bool, cp: int = 1, cp_mode: str = "") -> int:
    """Bytes one transformer block saves for backward for b sequences, on one tp rank.

    Per block, E = b*s*h elements, A = b*(heads/tp)*s (measured with saved_tensors_hooks):
      ln_1 input E (residual dtype) + mean/rstd 2bs fp32; q/k/v input E (autocast: three 16-bit
      copies, one per Linear); q, k, v 3E/tp; SDPA output E/tp (= out_proj input) + logsumexp
      4A bytes; ln_2 input E + 2bs; fc input E; fc output 4E/tp (GELU input); GELU output 4E/tp;
      with dropout two masks E/tp each (CUDA: bool). fp32: 16E*4 = 64sbh bytes where Korthikanti
      et al. count 34sbh in 16-bit with 5as^2b of attention matrices that SDPA never stores.
      tp: the replicated LayerNorm inputs and the Linear inputs stay whole; with sequence
      parallelism the LayerNorm inputs/stats and dropout masks are split over tp, but the
      all-gathered q/k/v and fc inputs are saved whole (DTensor keeps the gathered tensor).
      autocast's 16-bit copies of the weights are not here: `weight_copy_bytes`.
      cp (parallel/cp.py): every rank holds s/cp tokens of each sequence, so every term is per s/cp;
      ring attention saves what SDPA does (its own q, k, v, output and logsumexp) + E (its
      output's copy in out_proj's layout), allgather also the gathered K/V of the whole sequence
      instead of its own, 2 b s h (fp32), and the positions that put them in order (int64, s).
    Activation checkpointing keeps only the block input (E/tp with sp)."""
    s, h = g.block_size // cp, g.n_embd
    e = b * s * h
    seq = tp if sp else 1
    if checkpointed:
        return e * am.residual // seq
    heads = g.n_head // tp
    total = 2 * e * am.residual // seq  # ln_1 and ln_2 inputs
    total += 2 * 2 * b * s * 4 // seq  # their mean and rstd (fp32)
    linear_in = 3 * e * am.matmul + e * am.matmul if am.casts else 2 * e * am.residual  # qkv + fc inputs
    total += linear_in
    if am.fused_attention:
        total += 3 * e * am.matmul // tp + e * am.matmul // tp + 4 * b * heads * s  # q k v, out, lse
        if cp > 1 and heads > 1:  # cp attention's output is (b, heads, s, d) contiguous, unlike
            # SDPA's, whose transpose to out_proj's (b, s, h) is a view: the transpose copies it and
            # out_proj saves the copy (with one head on the rank the transpose is a view: no copy)
            total += e * am.matmul // tp
        if cp_mode == "allgather":  # the whole sequence's K/V in place of this rank's, and its order
            total += 2 * b * (s * cp - s) * h * am.matmul // tp + 8 * s * cp
    else:  # math kernel: scaled q, k^T, v, softmax, dropout mask, dropped softmax, output copy;
        # autocast runs it in fp32 (measured on CPU), so only the out_proj input is 16-bit
        attn = 4 if am.casts else am.matmul
        total += 3 * e * attn // tp + 3 * b * heads * s * s * attn + e * am.matmul // tp
    if g.qk_norm:  # rms_norm keeps fp32 copies of its q and k inputs (it computes in fp32 whatever
        # their dtype; measured), one more q-sized tensor of the matmul dtype, and an fp32 rstd of each
        total += (2 * e * 4 + e * am.matmul) // tp + 2 * b * heads * s * 4
    total += 8 * e * am.matmul // tp  # GELU input and output (4h each), or ReLU's output and its square
    if g.dropout > 0:
        total += 2 * e * (am.matmul if am.cpu_masks else 1) // seq
    return total


def weight_copy_bytes(g: GPTConfig, am: ActivationModel, blocks: int, last: bool, lay: PlannedLayout) -> int:
    """The 16-bit copies of the weights that autocast makes and backward keeps, for a stage of
    `blocks` blocks (+ the LM head's on the last stage). Autocast caches the cast of a parameter
    until its outermost context ends: a pipeline step (parallel/pp.py) runs all its micro-batches
    in one context, so each weight is cast once per step however many micro-batches are in flight
    (found by the dry run: the per-micro-batch figure was 1.5x the measured one at 2 micro-batches);
    the micro-batch loop (parallel/step.py) enters it per micro-batch."""
    if not am.casts:
        return 0
    head = ceil_div(g.vocab_size, lay.tp if lay.tp_vocab_parallel else 1) * g.n_embd if last else 0
    # recomputed blocks keep no copies; the head is never recomputed
    in_blocks = 0 if lay.activation_checkpointing else blocks * _block_weights(g, lay.tp)
    return (in_blocks + head) * am.matmul


def _block_weights(g: GPTConfig, tp: int) -> int:
    """Elements of one block's four Linear weights on one tp rank: 12h^2 / tp."""
    return 12 * g.n_embd * g.n_embd // tp


def stage_activation_bytes(g: GPTConfig, am: ActivationModel, b: int, blocks: int, first: bool,
                           last: bool, lay: PlannedLayout) -> int:
    """Saved-for-backward bytes of one pipeline stage (or the whole model) for one micro-batch of
    b sequences: its blocks, plus token/position ids (and the embedding dropout mask) on the
    first stage, plus ln_f, the LM head input and the loss's log-softmax (fp32, b*s*V; over
    tp ranks with vocab-parallel loss) on the last. Without autocast's weight copies
    (weight_copy_bytes)."""
    s, h, v = g.block_size // lay.cp, g.n_embd, g.vocab_size  # cp: this rank's tokens of each sequence
    tp, sp = lay.tp, lay.sequence_parallel
    seq = tp if sp else 1
    total = blocks * block_activation_bytes(g, am, b, tp, sp, lay.activation_checkpointing, lay.cp, lay.cp_mode)
    if first:
        total += 8 * b * s + 8 * s  # token ids (the embedding's) and positions (int64)
        if g.dropout > 0:
            total += b * s * h * (am.residual if am.cpu_masks else 1) // seq
    if last:
        total += b * s * h * am.residual // seq + 2 * b * s * 4 // seq  # ln_f input, mean/rstd
        total += b * s * h * (am.matmul if am.casts else am.residual)  # LM head input (whole)
        total += 4 * b * s * ceil_div(v, tp if lay.tp_vocab_parallel else 1)  # log-softmax output
        total += 8 * b * s + 4  # targets (int64) and nll_loss's total weight
    return total


def rank_activation_bytes(g: GPTConfig, am: ActivationModel, lay: PlannedLayout,
                          inflight: dict[int, int]) -> tuple[int, int]:
    """(one micro-batch of each of this rank's stages, all micro-batches in flight): `inflight`
    maps each local stage to the micro-batches whose activations are alive at the rank's peak.
    Under a pipeline, autocast's weight copies are made once per step (weight_copy_bytes): they
    count once in flight and 1/m per micro-batch, m the step's micro-batches."""
    per_microbatch, in_flight = 0, 0
    pipelined = lay.pp > 1
    for s in sorted(inflight):
        blocks, first, last = lay.stage_blocks[s], s == 0, s == lay.num_stages - 1
        one = stage_activation_bytes(g, am, lay.micro_batch_size, blocks, first, last, lay)
        copies = weight_copy_bytes(g, am, blocks, last, lay)
        if pipelined:  # one copy per step
            per_microbatch += one + round(copies / lay.microbatches)
            in_flight += one * inflight[s] + copies
        else:  # a copy per micro-batch
            per_microbatch += one + copies
            in_flight += (one + copies) * inflight[s]
    return per_microbatch, in_flight


def transient_bytes(g: GPTConfig, am: ActivationModel, lay: PlannedLayout, holds_last_stage: bool) -> int:
    """Live at the peak but not saved: the logits and their fp32 gradient at the loss,
    b s V (e + 4) (V over tp with a vocabulary-parallel head; s/cp tokens under cp), or with
    activation checkpointing one block recomputed in backward, or context parallelism's buffers
    in an attention backward (`cp_buffer_bytes`), whichever is larger."""
    b = lay.micro_batch_size
    transient = cp_buffer_bytes(g, am, lay) if lay.cp > 1 else 0
    if holds_last_stage:
        vloc = ceil_div(g.vocab_size, lay.tp if lay.tp_vocab_parallel else 1)
        transient = max(transient, b * (g.block_size // lay.cp) * vloc * (am.matmul + 4))
    if lay.activation_checkpointing:
        full = block_activation_bytes(g, am, b, lay.tp, lay.sequence_parallel, False)
        full += _block_weights(g, lay.tp) * am.matmul if am.casts else 0  # the recompute's weight copies
        transient = max(transient, full)
    return transient


def cp_buffer_bytes(g: GPTConfig, am: ActivationModel, lay: PlannedLayout) -> int:
    """An estimate (the dry run compares saved bytes, not these) of what one attention backward
    holds beyond the saved tensors under cp, with a = 2 b (s/cp) h e the K/V of one rank's tokens
    (parallel/cp.py): ring 4a (the visiting K/V block and the one arriving, the dK/dV arriving and
    the next ones being summed); allgather 3 cp a (the whole sequence's dK/dV, their copy in rank
    order, and the receive buffer of gloo's all-to-all reduce-scatter)."""
    a = 2 * lay.micro_batch_size * (g.block_size // lay.cp) * g.n_embd * am.matmul
    return 3 * lay.cp * a if lay.cp_mode == "allgather" else 4 * a
