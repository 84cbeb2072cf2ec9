"""One pipeline rank's compute seconds in a step, and what a zero-bubble step's busiest rank
waits (planner/timing.py adds the communication and the optimizer: `step_time`).

Per pipeline rank, per optimizer step (T = micro_batch_size x M x block_size tokens of its dp rank):

    compute   = (T x 3 F / (peak x efficiency) + T x blocks x w x elementwise + overhead x blocks x M
                 + passes + copies + step_overhead + split + cp + sp + vocab) x busy   forward + backward (2x forward)
    vocab     = vocab_overhead x M on the last stage under tp with the vocabulary-parallel head: its
                embedding, head and loss_parallel cross-entropy's host work (DTensor), whatever the blocks
    passes    = W x M x weight_pass: each matmul call's cost per weight element whatever its rows (the
                kernel packs or streams its weight once a call), W = the rank's matmul weight elements
                (its blocks' tp-local ones, the LM head's on the last stage); the same FLOPs in more
                micro-batches cost more
    w         = h (h (1 + 1/t) / 2 under tp, with or without sequence parallelism): the activation
                elements per token a block's element-wise work (LayerNorm, GELU, softmax, adds) goes through
    sp        = T x blocks x h x sp_elementwise with sequence parallelism: its redistributions' work
                per activation element beyond plain tp's (with sp_overhead's fixed part per block)
    busy      = busy_node_slowdown with more than one rank (CPU cores share the memory system), else 1
    overhead  = block_overhead (+ tp_overhead with tp > 1, + sp_overhead with sequence parallelism)
                (+ fsdp_overhead under FSDP2)     fixed host work
    copies    = fsdp_copy x its parameter elements x M under FSDP2: the copies in and out of its buffers
    recompute = T x F_blocks / (peak x efficiency) + (element-wise + overhead x blocks x M + the blocks'
                passes + cp) / 3   activation checkpointing
    F         = 2 x (matmul weights of its blocks, tp-local) + 4 s h x blocks / t + 2 V_local h (last stage)
    cp        = blocks x (cp_<mode>_overhead x M + T x h / t x cp_<mode>_elementwise) (x (cp - 1) for the
                ring)   context parallelism's attention beyond one fused attention over the same pairs
    split     = blocks x (split_backward_overhead x M + T x w x split_backward_elementwise)   zero-bubble
                schedules only: torch's input and weight halves of a backward cost more than one full backward
                (not the first stage's blocks: torch runs that stage's backward whole)
    idle      = zero-bubble schedules: torch's action lists played out with each stage's forward
                (a third of its compute), backward (two thirds, with its recomputation) and split
                per micro-batch, the span less the busiest rank's work (planner/schedule.py)
"""
from __future__ import annotations

from model import GPTConfig
from planner.hardware import Hardware
from planner.inventory import RankTensors, stage_tensors
from planner.records import PlannedLayout
from planner.schedule import zero_bubble_span
from planner.units import ceil_div


def compute_dtype(precision: str, fsdp_mixed: str) -> str:
    """The dtype the matmuls run in: autocast's, else FSDP2 mixed_precision's parameter dtype, else fp32."""
    return precision if precision != "fp32" else (fsdp_mixed if fsdp_mixed != "none" else "fp32")


def forward_flops_per_token(g: GPTConfig, lay: PlannedLayout, held: RankTensors, last: bool) -> tuple[float, float]:
    """(all of this rank's forward FLOPs per token, those of its blocks): 2 per matmul weight element,
    4 s h / t per block of attention scores and values (PaLM's 12 L h s per token is 3x this),
    the LM head 2 V h (V / t with a vocabulary-parallel head)."""
    weights = block_weights(held)
    blocks = 2 * weights + held.blocks * 4 * g.block_size * g.n_embd / lay.tp
    return blocks + 2 * head_weights(g, lay, last), blocks


def block_weights(held: RankTensors) -> int:
    """The matmul weight elements of this rank's blocks (tp-local; whole under FSDP2, which gathers
    them before use)."""
    return sum(t.elems for t in held if t.spec.where == "block" and len(t.shape) == 2)


def head_weights(g: GPTConfig, lay: PlannedLayout, last: bool) -> int:
    """The LM head's weight elements on the last stage, V h (V / t with a vocabulary-parallel head)."""
    return ceil_div(g.vocab_size, lay.tp if lay.tp_vocab_parallel else 1) * g.n_embd if last else 0


def causal_pairs(first: int, count: int) -> int:
    """(query, visible key) pairs of `count` consecutive query positions from `first` under a
    causal mask: query p sees p+1 keys, sum = count x first + count (count+1) / 2."""
    return count * first + count * (count + 1) // 2


def attention_flops(g: GPTConfig, lay: PlannedLayout, cp_rank: int, zigzag: bool = True) -> int:
    """Causal attention FLOPs of one cp rank's forward per optimizer step: 4 h/tp per (query,
    visible key) pair (q.k and p.v, 2 h each, over this rank's heads), x b x m x the layers of
    pipeline rank 0's stages (all of them without pp). Under
    the zigzag split rank r holds chunks r and 2n-1-r of c = s/2n positions (parallel/cp.py
    local_positions): (2n-1) c^2 + c(c+1) pairs whatever r, so the ranks' work is equal; a plain
    split into n pieces (zigzag=False) gives the last rank about 2n-1 times the first's. The
    kernels compute whole c x c blocks, the diagonal ones masked: equal within one block."""
    n = lay.cp
    if zigzag:
        c = g.block_size // (2 * n)
        pairs = causal_pairs(cp_rank * c, c) + causal_pairs((2 * n - 1 - cp_rank) * c, c)
    else:
        pairs = causal_pairs(cp_rank * g.block_size // n, g.block_size // n)
    layers = sum(lay.shape.stage_blocks[s] for s in lay.stages_of(0))
    return 4 * (g.n_embd // lay.tp) * pairs * lay.micro_batch_size * lay.microbatches * layers


def rank_tokens(g: GPTConfig, lay: PlannedLayout) -> int:
    """T: the tokens one rank's blocks work through in a step (micro-batch x M x block; its share
    of each sequence under cp)."""
    return lay.micro_batch_size * lay.microbatches * g.block_size // lay.cp


def unsplit_blocks(lay: PlannedLayout, stages: list[int]) -> int:
    """Blocks of `stages` whose backward a zero-bubble schedule runs whole: the first stage's (torch
    skips its input half, nothing before it needs an input gradient, and runs its backward as the
    weight half)."""
    return lay.stage_blocks[0] if 0 in stages else 0


def rank_compute(g: GPTConfig, lay: PlannedLayout, held: RankTensors, last: bool, hw: Hardware,
                 dtype: str, unsplit: int = 0) -> tuple[float, float]:
    """(forward + backward seconds, recomputation seconds) of one pp rank's step. `unsplit`: blocks
    among its own that pay no split backward (`unsplit_blocks`)."""
    tokens = rank_tokens(g, lay)
    rate = hw.peak(dtype) * hw.compute_efficiency
    fwd, fwd_blocks = forward_flops_per_token(g, lay, held, last)
    overhead = block_overhead(lay, hw) * held.blocks * lay.microbatches
    # FSDP2's copies in and out of its buffers, per micro-batch (first order: the gradients' chunk-cat
    # runs once a step where micro-batches accumulate unsynchronised); recomputation copies nothing
    copies = hw.fsdp_copy * held.elems * lay.microbatches if fsdp_sharded(lay) else 0.0
    elementwise = tokens * held.blocks * activation_width(g, lay) * hw.elementwise  # through the blocks
    # every matmul call's pass over its weight, once per micro-batch whatever its rows
    blocks_passes = block_weights(held) * lay.microbatches * hw.weight_pass
    passes = blocks_passes + head_weights(g, lay, last) * lay.microbatches * hw.weight_pass
    if lay.tp > 1 and lay.sequence_parallel:  # its redistributions' copies beyond plain tp's (calibrated)
        elementwise += tokens * held.blocks * g.n_embd * hw.sp_elementwise
    split = split_seconds(g, lay, held.blocks - unsplit, hw)
    cp = context_parallel_extra(g, lay, held, hw, tokens)
    # the vocabulary-parallel embedding, head and cross-entropy's host work, once per micro-batch
    # (first order: all of it on the last stage, where the head and the loss are; the embedding's
    # masked lookup and its all-reduce's dispatch are the smaller part)
    vocab = hw.vocab_overhead * lay.microbatches if lay.tp_vocab_parallel and last else 0.0  # set only under tp
    compute = tokens * 3 * fwd / rate + elementwise + overhead + passes + copies + hw.step_overhead + split + cp + vocab
    recompute = ((tokens * fwd_blocks / rate + (elementwise + overhead + blocks_passes + cp) / 3)
                 if lay.activation_checkpointing else 0.0)
    busy = busy_factor(lay, hw)  # every device of the node computes
    return compute * busy, recompute * busy


def split_seconds(g: GPTConfig, lay: PlannedLayout, blocks: int, hw: Hardware) -> float:
    """What torch's input and weight halves of `blocks` blocks' backward cost beyond one full
    backward over the step, under a zero-bubble schedule (0 otherwise)."""
    if not splits_backward(lay):
        return 0.0
    return blocks * (lay.microbatches * hw.split_backward_overhead
                     + rank_tokens(g, lay) * activation_width(g, lay) * hw.split_backward_elementwise)


def zero_bubble_idle(g: GPTConfig, lay: PlannedLayout, hw: Hardware, dtype: str) -> float:
    """The seconds the busiest rank of a zero-bubble step waits: torch's action lists played out
    (planner/schedule.py zero_bubble_span) with each stage's own costs per micro-batch as
    `rank_compute` prices them (its forward a third of its compute, its backward two thirds with
    any recomputation, the split's extra apart); the span less the busiest rank's work."""
    last, m, busy = lay.num_stages - 1, lay.microbatches, busy_factor(lay, hw)
    forward, backward, split = [], [], []
    for s, held in enumerate(stage_tensors(g, lay)):
        work, recompute = rank_compute(g, lay, held, s == last, hw, dtype, unsplit=held.blocks)
        work -= hw.step_overhead * busy  # once a step, not once a stage
        forward.append(work / 3 / m)
        backward.append((2 * work / 3 + recompute) / m)
        split.append(split_seconds(g, lay, held.blocks - unsplit_blocks(lay, [s]), hw) * busy / m)
    span, ranks_busy = zero_bubble_span(lay, forward, backward, split)
    return span - max(ranks_busy)


def busy_factor(lay: PlannedLayout, hw: Hardware) -> float:
    """How much slower a rank computes beside the others of its node: the hardware's
    busy_node_slowdown with more than one rank (CPU cores share the memory system), else 1."""
    return hw.busy_node_slowdown if lay.world > 1 else 1.0


def context_parallel_extra(g: GPTConfig, lay: PlannedLayout, held: RankTensors, hw: Hardware, tokens: int) -> float:
    """What context parallelism's attention costs one rank beyond one fused attention over the same
    pairs (its blocks of the kernel, the merges, the chunks' slicing): per block per micro-batch the
    hardware's fixed cp_<mode>_overhead, and cp_<mode>_elementwise per activation element of its
    heads (tokens x width / tp per block), the ring's x (cp - 1)."""
    if lay.cp == 1:
        return 0.0
    fixed, per_element = {"ring": (hw.cp_ring_overhead, hw.cp_ring_elementwise),
                          "allgather": (hw.cp_allgather_overhead, hw.cp_allgather_elementwise)}[lay.cp_mode]
    # measured at cp 2 (tools/calibrate_engines.py); the ring's kernel blocks, merges and shifts per
    # rank grow with cp - 1, allgather's blocks stay at most 4 a rank (first order, not measured beyond 2)
    grows = lay.cp - 1 if lay.cp_mode == "ring" else 1
    return grows * held.blocks * (lay.microbatches * fixed + tokens * g.n_embd / lay.tp * per_element)


def splits_backward(lay: PlannedLayout) -> bool:
    """Does the schedule run each backward as torch's input half and weight half (a walk of the
    autograd graph for the parameter groups, then one autograd call per group)? The zero-bubble
    ones; their cost beyond a full backward is the hardware's split_backward_* (tools/calibrate.py
    split_rates)."""
    return lay.pp > 1 and lay.pp_schedule == "zero_bubble"


def activation_width(g: GPTConfig, lay: PlannedLayout) -> float:
    """The activation elements per token one rank's block works through element-wise (the
    hardware's `elementwise` seconds each): the width h; tp splits attention's and the MLP's (half
    of it, first order) and repeats the LayerNorms and residual adds on every rank: h (1 + 1/t) / 2.
    Sequence parallelism splits those too, but its redistributions (the gathers' and
    reduce-scatters' chunks concatenated and split) cost the rank more than it saves: on the fake
    process group a 2 x 128 GPT over 8 x 256 tokens measured 2.0 ms slower at tp 2 with it than
    without (2026-11-29), where h / t here predicted 3.1 ms faster. So it is priced as plain tp's
    width plus what the calibration measures it adds (sp_overhead per block, sp_elementwise per
    activation element: tools/calibrate_engines.py)."""
    h, t = g.n_embd, lay.tp
    return h * (1 + 1 / t) / 2


def fsdp_sharded(lay: PlannedLayout) -> bool:
    """Are this layout's parameters FSDP2-sharded (fsdp, zero-3, HSDP over more than one rank)?"""
    return lay.strategy.value in ("fsdp", "zero-3") and lay.grad_ranks > 1


def block_overhead(lay: PlannedLayout, hw: Hardware) -> float:
    """Fixed seconds per block per micro-batch: every block's, plus the engines' host work where a
    block is tensor-parallel (DTensor; more with sequence parallelism's redistributions) or
    FSDP2-sharded (fsdp, zero-3, HSDP)."""
    tp = (hw.tp_overhead + (hw.sp_overhead if lay.sequence_parallel else 0.0)) if lay.tp > 1 else 0.0
    return hw.block_overhead + tp + (hw.fsdp_overhead if fsdp_sharded(lay) else 0.0)
