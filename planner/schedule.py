"""Pipeline schedules: which micro-batches hold activations at a rank's peak, and the idle
fraction of a schedule step.

gpipe keeps all M micro-batches of a stage; 1f1b min(M, p - rank) (torch's warm-up, then one
backward before each forward); the interleaved and zero-bubble schedules are replayed from torch's
own action order (`torch.distributed.pipelining.schedules`, private API, torch 2.13). Bubble:
(p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v m+p-1) interleaved, and for zero-bubble torch's action
lists of every rank played out with F = I = W (tests/test_planner.py checks that the same play of
the interleaved lists gives the interleaved formula); the step time plays them with each stage's
own costs (`zero_bubble_span`, priced by planner/compute.py `zero_bubble_idle`).
"""
from __future__ import annotations

import functools
from typing import Callable

from torch.distributed.pipelining import schedules

from planner.records import PlannedLayout

_KINDS = schedules._ComputationType  # private, torch 2.13: F, I, W and full B


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
    graph for it) frees it; returns the counts at the moment most are alive (`rank_actions` says
    where the list comes from); tests/test_planner.py checks the result against the Megatron
    warm-up formula."""
    actions = rank_actions(lay.pp_schedule, lay.pp, lay.microbatches, lay.stages_per_rank, rank)
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


def rank_actions(schedule: str, p: int, m: int, v: int, rank: int) -> list:
    """One pp rank's compute actions in torch's order (interleaved_1f1b or zero_bubble, p ranks, M
    micro-batches, v stages per rank). The schedules compute the list from these integers in
    `_calculate_single_rank_operations` (torch 2.13, private), so an instance is made without
    stages or a process group to reach it."""
    if schedule == "interleaved_1f1b":
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
    return [a for a in obj._calculate_single_rank_operations(rank) if a is not None]


def bubble_fraction(lay: PlannedLayout) -> float:
    """Idle fraction of a schedule step, averaged over ranks, when a stage's forward, its input
    gradient and its weight gradient take one unit each (a full backward two): the formulas for
    gpipe/1f1b and interleaved, torch's own zero-bubble action lists played out (`simulated_bubble`:
    weight gradients fill most of the bubble, not all: 1/13 at p = 2, M = 4, against 1F1B's 1/5)."""
    if lay.pp == 1:
        return 0.0
    if lay.pp_schedule == "zero_bubble":
        return _zero_bubble(lay.pp, lay.microbatches, lay.stages_per_rank)
    v = lay.stages_per_rank if lay.pp_schedule == "interleaved_1f1b" else 1
    return (lay.pp - 1) / (v * lay.microbatches + lay.pp - 1)


@functools.lru_cache(maxsize=256)
def _zero_bubble(pp: int, microbatches: int, stages_per_rank: int) -> float:
    """One play per schedule shape: a plan asks for the same one per layout and per rank (p = 128,
    M = 512 takes about a second)."""
    return simulated_bubble(_zero_bubble_actions(pp, microbatches, stages_per_rank), pp * stages_per_rank)


@functools.lru_cache(maxsize=64)
def _zero_bubble_actions(pp: int, microbatches: int, stages_per_rank: int) -> tuple[list, ...]:
    """Every rank's zero-bubble action list, computed once per schedule shape (the equal-cost
    fraction and the step time's play both read them)."""
    return tuple(rank_actions("zero_bubble", pp, microbatches, stages_per_rank, r) for r in range(pp))


def simulated_bubble(per_rank: list[list], stages: int) -> float:
    """The idle fraction of the ranks' action lists played out with unit costs (a forward, an
    input gradient and a weight gradient one unit each, a full backward two): 1 - busy / span
    averaged over ranks."""
    span, busy = played(per_rank, stages, lambda stage, kind: 2.0 if kind == _KINDS.FULL_BACKWARD else 1.0)
    return sum(1 - b / span for b in busy) / len(per_rank)


def played(per_rank: list[list], stages: int, cost: Callable[[int, object], float]) -> tuple[float, list[float]]:
    """(span, each rank's busy time) of the ranks' action lists played out: each rank runs its
    actions in order, an action starts when its rank is free and what it needs is done (a forward:
    the previous stage's forward of that micro-batch; an input or full backward: the next
    stage's), and lasts cost(stage, kind). Communication is free here (the planner's collective
    terms cost it)."""
    backward = (_KINDS.FULL_BACKWARD, _KINDS.BACKWARD_INPUT)
    done: dict[tuple[int, int, str], float] = {}  # (stage, micro-batch, "F" or "B") -> end time
    free, busy, next_action = [0.0] * len(per_rank), [0.0] * len(per_rank), [0] * len(per_rank)
    moved = True
    while moved:
        moved = False
        for r, actions in enumerate(per_rank):
            while next_action[r] < len(actions):
                a = actions[next_action[r]]
                s, i, kind = a.stage_index, a.microbatch_index, a.computation_type
                need = ((s - 1, i, "F") if kind == _KINDS.FORWARD and s > 0 else
                        (s + 1, i, "B") if kind in backward and s < stages - 1 else None)
                if need is not None and need not in done:
                    break  # wait for another rank
                seconds = cost(s, kind)
                free[r] = max(free[r], done[need] if need else 0.0) + seconds
                busy[r] += seconds
                if kind != _KINDS.BACKWARD_WEIGHT:  # nothing waits for a weight gradient
                    done[(s, i, "B" if kind in backward else "F")] = free[r]
                next_action[r] += 1
                moved = True
    if any(n < len(actions) for n, actions in zip(next_action, per_rank)):
        raise RuntimeError("the pipeline schedule's action lists deadlock")  # torch's lists never do
    return max(free), busy


def zero_bubble_span(lay: PlannedLayout, forward: list[float], backward: list[float],
                     split: list[float]) -> tuple[float, list[float]]:
    """(span, each rank's busy seconds) of a zero-bubble step: torch's action lists played out with
    each stage's own costs, its forward, backward and split-backward extra seconds per micro-batch.
    An input half and a weight half each cost half the backward plus half the extra, except on the
    first stage: torch skips its input half (nothing before it needs a gradient) and runs its
    whole backward, unsplit, as the weight half (torch/distributed/pipelining/stage.py,
    backward_one_chunk)."""
    def cost(stage: int, kind) -> float:
        if kind == _KINDS.FORWARD:
            return forward[stage]
        if kind == _KINDS.FULL_BACKWARD:
            return backward[stage]
        if stage == 0:
            return 0.0 if kind == _KINDS.BACKWARD_INPUT else backward[0]
        return (backward[stage] + split[stage]) / 2
    return played(list(_zero_bubble_actions(lay.pp, lay.microbatches, lay.stages_per_rank)), lay.num_stages, cost)
