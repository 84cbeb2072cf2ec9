"""Pipeline schedules: which micro-batches hold activations at a rank's peak, and the idle
fraction of a schedule step.

gpipe keeps all M micro-batches of a stage; 1f1b min(M, p - rank) (torch's warm-up, then one
backward before each forward); the interleaved and zero-bubble schedules are replayed from torch's
own action order (`torch.distributed.pipelining.schedules`, private API, torch 2.13). Bubble:
(p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v m+p-1) interleaved, 0 for zero-bubble.
"""
from __future__ import annotations

from torch.distributed.pipelining import schedules

from costs.records import PlannedLayout


def inflight_per_stage(lay: PlannedLayout) -> list[dict[int, int]]:
    """For each pp rank, its local stages' micro-batches whose activations are alive at the
    rank's peak. gpipe: all M; 1f1b: min(M, p - rank) (torch's warm-up, then one backward before
    each forward); interleaved and zero-bubble schedules: torch's own action order replayed."""
    p, m = lay.pp, lay.microbatches
    out = []
    for r in range(p):
        stages = lay.stages_of(r)
        if lay.pp_schedule == "gpipe":
            out.append({s: m for s in stages})
        elif lay.pp_schedule == "1f1b":
            out.append({s: min(m, p - s) for s in stages})
        else:
            out.append(_replay_order(lay, r, stages))
    return out


def _replay_order(lay: PlannedLayout, rank: int, stages: list[int]) -> dict[int, int]:
    """Replays one rank's action list of torch.distributed.pipelining: a forward adds a
    micro-batch to its stage, a full backward (or, split, the weight half: the input half keeps the
    graph for it) frees it; returns the counts at the moment most are alive. The schedules compute
    the list from a few integers in `_calculate_single_rank_operations` (torch 2.13, private), so
    an instance is made without stages or a process group to reach it; tests/test_planner.py
    checks the result against the Megatron warm-up formula."""
    p, m, v = lay.pp, lay.microbatches, lay.stages_per_rank
    if lay.pp_schedule == "interleaved_1f1b":
        cls = schedules.ScheduleInterleaved1F1B
    elif v == 2:
        cls = schedules.ScheduleZBVZeroBubble
    else:
        cls = schedules.ScheduleInterleavedZeroBubble
    obj = cls.__new__(cls)
    obj.pp_group_size, obj.n_local_stages, obj._n_microbatches = p, v, m
    obj.num_stages = p * v
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    actions = [a for a in obj._calculate_single_rank_operations(rank) if a is not None]
    kinds = schedules._ComputationType
    split = any(a.computation_type == kinds.BACKWARD_WEIGHT for a in actions)
    frees = kinds.BACKWARD_WEIGHT if split else kinds.FULL_BACKWARD
    live = {s: 0 for s in stages}
    peak = dict(live)
    for a in actions:
        if a.computation_type == kinds.FORWARD:
            live[a.stage_index] += 1
        elif a.computation_type == frees:
            live[a.stage_index] -= 1
        # a rank's stages hold about the same number of blocks: the most alive in total is its peak
        if sum(live.values()) > sum(peak.values()):
            peak = dict(live)
    return peak


def bubble_fraction(lay: PlannedLayout) -> float:
    """Idle fraction of a schedule step when forward and backward of a stage take equal time;
    zero-bubble schedules fill it with weight-gradient work (about 0 when F = B = W)."""
    if lay.pp == 1 or lay.pp_schedule == "zero_bubble":
        return 0.0
    v = lay.stages_per_rank if lay.pp_schedule == "interleaved_1f1b" else 1
    return (lay.pp - 1) / (v * lay.microbatches + lay.pp - 1)
