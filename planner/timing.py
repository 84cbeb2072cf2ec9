"""A layout's predicted optimizer step time on a `Hardware` (planner/hardware.py): `step_time`.

Per pipeline rank, per optimizer step (T = micro_batch_size x M x block_size tokens of its dp rank):

    compute   = one rank's forward and backward, recomputation, split backward: planner/compute.py
    bubble    = max compute x b / (1 - b)    b = (p-1)/(m+p-1) gpipe/1f1b, (p-1)/(vm+p-1) interleaved;
                zero-bubble: torch's action lists played out with each stage's own forward, backward and
                split costs, the span less the busiest rank's work (planner/schedule.py zero_bubble_span)
    optimizer = 32 bytes x parameters it steps / memory bandwidth    AdamW reads p, g, m, v and writes p, m, v
                (+ dtensor_optimizer_overhead x its parameter tensors under FSDP2 or tp: the fused kernel on
                 DTensors, one call per kind of parameter under tp)
    collective = calls x ring steps x latency + bytes sent / bandwidth      (alpha-beta, per link class)
                (FSDP2's gathers and reduce-scatters: a call's latency at least fsdp_call_latency, its
                 bytes at fsdp_byte_time each inside a node, what they cost on the backend in FSDP2's
                 own pattern where the hardware measured them)
    copies    = ZeRO-1/2's packing around its calls: tensors x zero_overhead + elements x zero_copy, per
                reduce-scatter and all-gather (ZERO_COPY_BYTES / memory bandwidth an element where the
                hardware gives neither figure), x busy like the compute (the rank's cores do it)
    latency   = near_latency + (latency - near_latency) x min(1, gap / latency_gap) where the hardware
                gives both (local: gloo's threads sleep between calls, so a call costs more the longer
                the rank computed since its last one); gap = the rank's compute / its calls per step
                (the gradient norm's included), x ranks / cores on a shared node with more ranks than cores

A group's link class follows the mesh order of parallel/layout.py, ("pp", "dp", "tp") with tp
innermost: global rank = (pp x dp + dp_rank) x tp + tp_rank, so a group of n ranks at stride st
spans n x st consecutive ranks, and stays inside a node when that span divides the devices per
node (or the whole world fits in one node). tp (stride 1) is placed first inside a node, dp next,
pp last; HSDP's shard groups inside its replica groups.

What overlaps with compute, and why:
- DDP's bucket all-reduces: launched asynchronously by the reducer as each bucket's gradients are
  ready, during the last micro-batch's backward; FSDP2's all-gathers (prefetched one unit ahead, in
  forward and backward) and its reduce-scatters (and HSDP's all-reduce) run on their own stream
  while the next unit computes. Hidden up to the compute they overlap (the last micro-batch's
  backward for DDP, the whole step for FSDP2); one call's worth is always exposed (the first
  gather, the last bucket).
- Not overlapped: tensor parallelism's all-reduces / all-gathers (the next operator needs their
  result), pipeline sends and receives (a stage waits for its input; torch's schedules wait on them
  before the next action), ZeRO-1/2's reduce-scatter (this project's engine issues it synchronously
  in the backward hook: parallel/zero_shard.py) and its all-gather of updated slices (after the
  optimizer step, nothing left to overlap), the tied embedding's all-reduce (after backward).
On a CPU (`local`: Hardware.overlap false) nothing is hidden: the same cores that compute do a
collective's copies and sums (gloo's threads, the kernel's loopback TCP), so an overlapped
collective takes its time from the compute beside it.
A shared node (`local`: Hardware.shared_node) with more ranks than cores runs each rank on
cores / ranks of a core, and every term stretches by ranks / cores: the compute, and the
collectives too, since each ring step waits until both of its ranks hold a core (a first-order
figure: at 4 ranks on 2 cores the measured steps still vary by up to 60% between runs,
docs/planner.md).
The step is the slowest pipeline rank's compute + the bubble + the largest exposed
communication and optimizer time of any rank. tokens/s = batch_size x block_size / step; MFU
counts model FLOPs only (6N + 12 L h s per token, no recomputation) over every rank's peak.
"""
from __future__ import annotations

import math

from model import GPTConfig
from parallel.options import Engine
from planner.compute import (
    block_overhead,
    busy_factor,
    fsdp_sharded,
    rank_compute,
    rank_tokens,
    splits_backward,
    unsplit_blocks,
    zero_bubble_idle,
)
from planner.hardware import Hardware, Link
from planner.inventory import RankTensors
from planner.records import Collective, PlannedLayout, StepTime, TimeTerm
from planner.schedule import bubble_fraction

OPTIMIZER_BYTES = 32  # AdamW per element: read p, g, m, v (16) and write p, m, v (12), + the clip norm's read
# ZeRO-1/2 per element of a bucket at n = 2 (parallel/zero_shard.py), each a read and a write of 4
# bytes: a reduce-scatter pads each tensor (8) and concatenates them (8), the backend copies this
# rank's own chunk (4), the rows are summed (6) and divided (4); an all-gather pads and concatenates
# the slice (8), the backend copies it (4), the rows are split (8) and copied into the parameters
# (8). About 30 each (first order: a backend that moves its own chunk without a copy does less)
ZERO_COPY_BYTES = 30


def model_flops_per_token(g: GPTConfig) -> float:
    """model.GPT.flops_per_token without building the model: 6N + 12 L h s (N: matmul weights,
    the position embedding and an untied input embedding are lookups)."""
    h, layers = g.n_embd, g.n_layer
    block = 12 * h * h + (13 * h if g.bias else 2 * h)  # q k v out fc proj (+ 9h of biases) + 2 LayerNorms
    n = layers * block + g.vocab_size * h + (2 * h if g.bias else h)
    return 6 * n + 12 * layers * h * g.block_size


def group_link(lay: PlannedLayout, group: str, hw: Hardware) -> tuple[int, Link, str]:
    """(ranks in the group, the link it runs on, its name) by where parallel/layout.py puts it.

    A group across nodes with k of its ranks in each node runs k rings side by side, each
    leaving the node through another rank's network card (NCCL's channels): the ring moves k
    times one card's bandwidth, up to the link inside the node that carries every ring. On a
    shared node every group is inside it."""
    cp, tp = lay.cp, lay.tp  # cp sits between dp and tp (parallel/layout.py), dp_cp is dp x cp flattened
    size, stride = {"dp": (lay.dp, cp * tp), "dp_shard": (lay.dp_shard, tp),
                    "dp_replicate": (lay.dp_replicate, lay.dp_shard * tp), "tp": (tp, 1), "cp": (cp, tp),
                    "dp_cp": (lay.dp * cp, tp), "pp": (2, lay.dp * cp * tp),
                    "tied": (2, lay.dp * cp * tp * max(1, lay.pp - 1))}[group]
    world, per_node = lay.world, hw.devices_per_node
    span = size * stride
    if hw.shared_node or world <= per_node or (span <= per_node and per_node % span == 0):
        return size, hw.intra_node, "intra-node"
    in_node = max(1, min(size, per_node // stride)) if group not in ("pp", "tied") else 1  # a send: one card
    if in_node == 1:
        return size, hw.inter_node, "inter-node"
    bandwidth = min(in_node * hw.inter_node.bandwidth, hw.intra_node.bandwidth)
    return size, Link(bandwidth, hw.inter_node.latency, hw.inter_node.near_latency), f"inter-node, {in_node} cards"


def step_latency(link: Link, gap: float, hw: Hardware) -> float:
    """Seconds per ring step of a call made `gap` seconds of compute after the rank's previous call:
    the link's near_latency for a call right after another, its latency after hw.latency_gap or
    more, in proportion between (first order: measured at both ends by tools/calibrate.py, where
    a 4 KB gloo all-reduce after ~6 ms of matmuls costs 1.0-2.3x one right after another, median
    1.6x over 24 calibrations, and an all-gather 2-5x)."""
    if link.near_latency is None or hw.latency_gap <= 0:
        return link.latency
    return link.near_latency + (link.latency - link.near_latency) * min(1.0, gap / hw.latency_gap)


def fsdp_own_call(c: Collective, lay: PlannedLayout) -> bool:
    """Is `c` one of FSDP2's own all-gathers or reduce-scatters (not HSDP's all-reduce, tp's or cp's)?"""
    return fsdp_sharded(lay) and c.kind in ("all-gather", "reduce-scatter")


def fsdp_byte_time(c: Collective, lay: PlannedLayout, hw: Hardware, where: str) -> float:
    """Seconds per byte sent of an FSDP2 all-gather or reduce-scatter inside a node where the hardware
    measured them in FSDP2's own pattern (Hardware.fsdp_byte_time, at 2 local ranks), else 0: the
    call's bytes pay the link's bandwidth like any other's."""
    return hw.fsdp_byte_time if fsdp_own_call(c, lay) and where == "intra-node" else 0.0


def collective_seconds(c: Collective, lay: PlannedLayout, hw: Hardware, gap: float = math.inf) -> tuple[float, str]:
    """alpha-beta: each call pays a latency per ring step (all-reduce 2(n-1), reduce-scatter and
    all-gather n-1, a send 1), the bytes sent pay the bandwidth. The data-parallel engines'
    all-gathers and reduce-scatters, cp's and sequence parallelism's all-gathers, inside a node use
    the hardware's own figures for them where it gives them (gather_link, scatter_link: gloo's,
    measured by `local`); FSDP2's own inside a node at the hardware's fsdp_byte_time where it gives
    one (fsdp_byte_time). On a backend that runs a
    reduce-scatter as an all-reduce (gloo), sequence parallelism's reduce-scatters pay both twice.
    `gap`: the compute before each call since the rank's previous one (step_latency)."""
    n, link, where = group_link(lay, c.group, hw)
    own = {"all-gather": hw.gather_link, "reduce-scatter": hw.scatter_link}.get(c.kind)
    if own is not None and where == "intra-node":  # gloo's gathers and scatters at their own rates
        link = own
    if c.kind == "send-recv" or (c.kind == "cp" and lay.cp_mode == "ring"):  # one shift of the ring per call
        steps = 1
    elif c.kind == "all-reduce" or (c.kind == "tp" and not lay.sequence_parallel):
        steps = 2 * (n - 1)
    else:
        steps = n - 1
    # an FSDP2 gather or reduce-scatter never costs less than its calls measured on the backend in
    # FSDP2's own pattern (Hardware.fsdp_call_latency, measured at 2 ranks, one ring step: taken as
    # the least a call costs, whatever its ring steps; 0 where not measured), and its bytes pay the
    # time each measured in that pattern where there is one (fsdp_byte_time)
    floor = hw.fsdp_call_latency if fsdp_own_call(c, lay) else 0.0
    byte_time = fsdp_byte_time(c, lay, hw, where) or 1 / link.bandwidth
    seconds = c.calls * max(floor, steps * step_latency(link, gap, hw)) + c.moved_bytes * byte_time
    if c.gather_calls and hw.gather_link and where == "intra-node":
        # cp's allgather mode and sequence parallelism: their all-gathers at the backend's own rates
        # (DTensor's and cp's call the same all_gather_into_tensor the calibration times), the rest,
        # cp's reduce-scatters (the project's, parallel/collectives.py) at its scatter rates and
        # sequence parallelism's calls at the link's
        gather = hw.gather_link
        rest = hw.scatter_link if c.kind == "cp" and hw.scatter_link else link
        seconds = (steps * (c.gather_calls * step_latency(gather, gap, hw)
                            + (c.calls - c.gather_calls) * step_latency(rest, gap, hw))
                   + c.gather_bytes / gather.bandwidth + (c.moved_bytes - c.gather_bytes) / rest.bandwidth)
    if hw.reduce_scatter_as_all_reduce:
        seconds += (c.reduce_scatter_calls * (n - 1) * step_latency(link, gap, hw)
                    + c.reduce_scatter_bytes / link.bandwidth)
    return seconds, where


def norm_all_reduces(lay: PlannedLayout) -> list[tuple[str, int, int]]:
    """(group, its ranks, calls) of the gradient norm's all-reduces in one step (Strategy.clip_grad_norm_,
    parallel/zero.py): one 4-byte all-reduce per same-layout group of sharded gradients over their mesh
    (ZeRO-1/2's slices: 1; FSDP2's Shard(0): 1; tensor parallelism's column- and row-wise shards: 2,
    3 with sequence parallelism; counted at the dispatcher by benchmarks/strategy_report.py at 2
    processes), and under pp one sum of the stages' squares over the pp group (sum_over_stages).
    Their bytes are nothing; each pays the per-call latency, 2(n-1) ring steps. A data-parallel
    shard on a tp mesh (fsdp x tp) is taken as the tp groups' count, priced on the dp shard group:
    first order, not measured (the counts above are the 2-process layouts')."""
    out = []
    tp_groups = (3 if lay.sequence_parallel else 2) if lay.tp > 1 else 0
    sharded = lay.strategy in (Engine.ZERO1, Engine.ZERO2, Engine.ZERO3, Engine.FSDP) and lay.dp_shard > 1
    if sharded:
        out.append(("dp_shard", lay.dp_shard, max(1, tp_groups)))
    elif tp_groups:
        out.append(("tp", lay.tp, tp_groups))
    if lay.pp > 1:
        out.append(("pp", lay.pp, 1))
    return out


def step_time(g: GPTConfig, lay: PlannedLayout, held: list[RankTensors], traffic: list[list[Collective]],
              optimizer_elems: list[int], hw: Hardware, dtype: str, batch_size: int) -> StepTime:
    """The predicted step (the module's doc): slowest compute + bubble + worst exposed rest."""
    last, world = lay.num_stages - 1, lay.world
    compute = [rank_compute(g, lay, h, lay.pp == 1 or last in lay.stages_of(r), hw, dtype,
                            unsplit=unsplit_blocks(lay, lay.stages_of(r)))
               for r, h in enumerate(held)]
    slow = max(range(len(compute)), key=lambda r: sum(compute[r]))
    work = sum(compute[slow])
    b = bubble_fraction(lay)
    if splits_backward(lay):  # the schedule played with the stages' own costs, not equal ones
        idle = zero_bubble_idle(g, lay, hw, dtype)
        bubble = TimeTerm("bubble", idle, idle, f"torch's {lay.pp_schedule} action lists played with each stage's "
                          f"forward, backward and split costs (b = {b:.3f} with equal ones)")
    else:
        bubble = TimeTerm("bubble", work * b / (1 - b), work * b / (1 - b),
                          f"compute x b/(1-b), b = {b:.3f} ({lay.pp_schedule})")
    rests = [_rank_rest(lay, traffic[r], optimizer_elems[r], sum(t.in_optimizer for t in held[r]), compute[r], hw)
             for r in range(len(held))]
    rest = max(rests, key=lambda terms: sum(t.exposed for t in terms))
    terms = [TimeTerm("compute", compute[slow][0], compute[slow][0],
                      f"{_flops_note(g, lay, held[slow])} at {hw.compute_efficiency:g} x {hw.peak(dtype) / 1e12:.4g} "
                      f"TFLOP/s ({dtype})"
                      f"{f' + {hw.elementwise * 1e9:.3g} ns x tokens x blocks x width' if hw.elementwise else ''}"
                      f" + {block_overhead(lay, hw) * 1e3:.3g} ms x blocks x M"
                      f"{f' + {hw.weight_pass * 1e9:.3g} ns x matmul weights x M' if hw.weight_pass else ''}"
                      f"{f' + {hw.fsdp_copy * 1e9:.3g} ns x parameters x M (FSDP2 copies)' if hw.fsdp_copy and fsdp_sharded(lay) else ''}"
                      f"{f' + {hw.step_overhead * 1e3:.3g} ms per step' if hw.step_overhead else ''}"
                      f"{' + the split backward (zero-bubble)' if splits_backward(lay) else ''}"
                      f"{f' + {hw.vocab_overhead * 1e3:.3g} ms x M (vocabulary-parallel head, last stage)' if hw.vocab_overhead and lay.tp_vocab_parallel else ''}"
                      f"{f' + context parallelism attention ({lay.cp_mode})' if lay.cp > 1 else ''}"
                      f"{f', x {hw.busy_node_slowdown:.3g} on a busy node' if hw.busy_node_slowdown > 1 and world > 1 else ''}")]
    if lay.activation_checkpointing:
        terms.append(TimeTerm("recompute", compute[slow][1], compute[slow][1], "one more forward of every block"))
    if b:
        terms.append(bubble)
    terms += rest
    share = oversubscription(lay, hw)
    if share > 1:
        terms = [_stretched(t, share) for t in terms]
    step = sum(t.exposed for t in terms)
    tokens = batch_size * g.block_size / step
    devices = min(world, hw.devices_per_node) if hw.shared_node else world  # ranks sharing cores share their peak
    mfu = model_flops_per_token(g) * tokens / (hw.peak(dtype) * devices)
    return StepTime(hw.name, step, tokens, mfu, terms)


def oversubscription(lay: PlannedLayout, hw: Hardware) -> float:
    """Ranks per core on a shared node (1 when every rank has its own device)."""
    return max(1.0, lay.world / hw.devices_per_node) if hw.shared_node else 1.0


def _stretched(term: TimeTerm, share: float) -> TimeTerm:
    return TimeTerm(term.name, term.seconds * share, term.exposed * share,
                    f"{term.formula}, x {share:g} ranks per core")


def _flops_note(g: GPTConfig, lay: PlannedLayout, held: RankTensors) -> str:
    return f"3 x forward FLOPs of {held.blocks} block(s) x {rank_tokens(g, lay)} tokens"


def _rank_rest(lay: PlannedLayout, traffic: list[Collective], opt_elems: int, tensors: int,
               compute: tuple[float, float], hw: Hardware) -> list[TimeTerm]:
    """One rank's communication terms (overlapped ones hidden up to the compute they run beside)
    and its optimizer step (`tensors`: the parameter tensors it steps, each a DTensor dispatch
    under FSDP2)."""
    terms = []
    window = sum(compute)  # compute that overlapped collectives share: each uses up what it hides
    norms = norm_all_reduces(lay)
    # first order: the rank's calls spread evenly over its compute (step_latency), which takes
    # ranks / cores as long on a shared node with more ranks than cores
    gap = sum(compute) * oversubscription(lay, hw) / max(1, sum(c.calls for c in traffic)
                                                         + sum(calls for _, _, calls in norms))
    for c in traffic:
        seconds, where = collective_seconds(c, lay, hw, gap)
        exposed, hidden = seconds, c.overlaps and hw.overlap
        if hidden:  # DDP's window is the last micro-batch's backward; FSDP2's the whole step
            fsdp = c.kind == "all-gather" or lay.strategy.value in ("fsdp", "zero-3")
            beside = window if fsdp else min(window, sum(compute) * 2 / 3 / lay.microbatches)
            exposed = max(seconds - beside, seconds / max(1, c.calls))
            window -= seconds - exposed
        byte_time = fsdp_byte_time(c, lay, hw, where)
        bytes_priced = f"x {byte_time * 1e9:.3g} ns (FSDP2's, measured)" if byte_time else "/ bandwidth"
        terms.append(TimeTerm(f"{c.kind} {c.group} ({where}{', overlapped' if hidden else ''})", seconds,
                              exposed, f"{c.calls} calls x ring steps x latency + {c.moved_bytes:,} B {bytes_priced}"))
    copies = engine_copies(traffic, lay, hw)
    if copies:
        terms.append(copies)
    for group, n, calls in norms:
        link = group_link(lay, group, hw)[1]
        seconds = calls * 2 * (n - 1) * step_latency(link, gap, hw)  # 4 bytes each: latency only
        terms.append(TimeTerm(f"norm all-reduce {group}", seconds, seconds,
                              f"{calls} calls x 2(n-1) ring steps x latency (the gradient norm's partial sums)"))
    # AdamW runs fused on every layout (parallel/strategy.py adamw; under tp one call per kind of
    # parameter, parallel/adamw.py): each DTensor pays a dispatch, FSDP2's shards and tp's (first
    # order: all of a tp rank's tensors counted so, its plain LayerNorms and embedding included)
    dtensors = fsdp_sharded(lay) or lay.tp > 1
    dispatch = tensors * hw.dtensor_optimizer_overhead if dtensors else 0.0
    seconds = opt_elems * OPTIMIZER_BYTES / hw.memory_bandwidth + dispatch
    terms.append(TimeTerm("optimizer", seconds, seconds,
                          f"{OPTIMIZER_BYTES} B x {opt_elems:,} stepped elements / memory bandwidth"
                          + (f" + {tensors} DTensors x {hw.dtensor_optimizer_overhead * 1e6:.3g} us" if dispatch else "")))
    return terms


def engine_copies(traffic: list[Collective], lay: PlannedLayout, hw: Hardware) -> TimeTerm | None:
    """What the engine's own packing and unpacking around its collectives costs the rank's cores
    (ZeRO-1/2: Collective.copied_tensors and copied_elems), x busy_factor like the compute: the
    hardware's zero_overhead per tensor and zero_copy per element where it gives either (a
    calibration whose noisy pair kept the fixed part alone gives zero_copy 0); else
    ZERO_COPY_BYTES per element at the memory bandwidth. None when the engine copies nothing."""
    tensors = sum(c.copied_tensors for c in traffic)
    elems = sum(c.copied_elems for c in traffic)
    if not elems:
        return None
    measured = bool(hw.zero_copy or hw.zero_overhead)
    per_element = hw.zero_copy if measured else ZERO_COPY_BYTES / hw.memory_bandwidth
    seconds = (tensors * hw.zero_overhead + elems * per_element) * busy_factor(lay, hw)
    how = (f"{tensors} tensors x {hw.zero_overhead * 1e6:.3g} us + {elems:,} elements x {per_element * 1e9:.3g} ns"
           if measured else f"{elems:,} elements x {ZERO_COPY_BYTES} B / memory bandwidth")
    return TimeTerm("ZeRO bucket copies", seconds, seconds,
                    f"{how} (packed before and unpacked after each reduce-scatter and all-gather)")
