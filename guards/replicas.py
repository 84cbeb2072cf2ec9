"""Replicas that must agree are checked before a snapshot: silent data corruption is caught.

Data parallelism keeps whole copies of what each rank steps, and tensor parallelism keeps copies of
what it does not shard (LayerNorm weights, biases after a row-parallel matmul, whatever its plan
marks Replicate). A bit flipped in one copy (memory, the wire) trains on silently: every rank
applies the same averaged update, so the copies never converge again, and the next snapshot saves
the flipped one. Here, before each snapshot, every rank fingerprints each local tensor that must
equal its replicas' (bit-exact: the sum of its bits read as integers, so any single flip changes
it) and the replicas compare them in one all-reduce per replicated mesh dimension (MAX of the
fingerprints and of their negation: they agree exactly where max == min). A mismatch is named
(rank, tensor, group) on every rank at once, and the run stops before saving: ReplicaMismatch,
exit 1, the last good snapshot stays the resume point.

What each layout can catch (docs/correctness.md):
- ddp, and zero-1/2's parameters: every dp rank holds the whole parameters; ddp also the whole
  AdamW state. zero-1/2 shard the AdamW state (nothing to compare), and their all-gather after each
  step re-copies every parameter slice from its owner: a flip in a slice this rank does not own
  heals at the next step; a flip in an owned slice spreads to every rank (then there is nothing left
  to compare, and only a check between the flip and that all-gather sees it).
- fsdp/zero-3: each rank holds a different shard: nothing replicated over dp. HSDP: each shard is
  replicated over the dp_replicate groups, with its AdamW state.
- tp: tensors its plan replicates, with their AdamW state.
- pp: stages hold different blocks; the tied embedding copy on the first and last stage is not
  compared (its gradients are summed across them, so it would be the same kind of check).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from parallel.env import control_group
from parallel.strategy import Strategy


class ReplicaMismatch(Exception):
    """Replicas that must be identical differ; raised on every rank at once (exit 1)."""

    def __init__(self, what: str, last_snapshot: Path | None):
        super().__init__(what)
        self.what, self.last_snapshot = what, last_snapshot


def fingerprint(t: torch.Tensor) -> int:
    """The sum, modulo 2^64, of the tensor's bytes read as 64-bit integers (zero-padded to whole
    lanes, so a copy at any address gives the same sum): one flipped bit changes one lane by 2^k,
    so the sum by 2^k, which is never 0 modulo 2^64. Integer addition is exact and associative, so
    every rank gets the same sum whatever order its kernel adds in. ~14 GB/s on one CPU thread."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    try:  # the bytes in place, when they are a whole number of 8-byte-aligned lanes
        return int(raw.view(torch.int64).sum())
    except RuntimeError:  # else the same bytes zero-padded in an aligned buffer: the same sum either way
        lanes = torch.zeros(-(-raw.numel() // 8), dtype=torch.int64)
        lanes.view(torch.uint8)[:raw.numel()] = raw
        return int(lanes.sum())


def _replicated_on_tp(p: torch.Tensor) -> bool:
    """A tp layout's parameter that every tp rank holds whole: a plain tensor, or a DTensor Replicate on "tp"."""
    if not isinstance(p, DTensor):
        return True
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" in names and isinstance(p.placements[names.index("tp")], Replicate)


def replicated_sets(strategy: Strategy, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """mesh dimension -> {name: local tensor} of everything that must be identical over it."""
    dims: dict[str, dict[str, torch.Tensor]] = {}
    lay = strategy.layout
    for dim, over in ((strategy.params_replicated_over(), strategy.optimizer_replicated_over()),
                      ("tp" if lay.tp_enabled else None, "tp" if lay.tp_enabled else None)):
        if dim is None:
            continue
        tensors = dims.setdefault(dim, {})
        for i, part in enumerate(strategy.unwrapped()):
            for name, p in part.named_parameters():
                if dim == "tp" and not _replicated_on_tp(p):
                    continue
                local = p.to_local() if isinstance(p, DTensor) else p
                tensors[f"{name}" if i == 0 else f"stage{i}.{name}"] = local
                if over == dim:
                    for key, v in optimizer.state.get(p, {}).items():
                        if torch.is_tensor(v) and v.numel() > 1:
                            tensors[f"{name} (AdamW {key})"] = v.to_local() if isinstance(v, DTensor) else v
    return dims  # every rank of a group has the same dims in the same order: no rank skips a collective


@torch.no_grad()
def check_replicas(strategy: Strategy, optimizer: torch.optim.Optimizer, step: int,
                   last_snapshot: Path | None) -> None:
    """Collective (every rank). Raises ReplicaMismatch on every rank when any replicas differ."""
    if not strategy.env.distributed or strategy.mesh is None:
        return
    findings = []
    for dim, tensors in replicated_sets(strategy, optimizer).items():
        group = strategy.mesh[dim].get_group()
        names = list(tensors)
        # on the training device: a mesh sub-group of a GPU run may have NCCL alone (no CPU tensors)
        mine = torch.tensor([fingerprint(tensors[n]) for n in names], dtype=torch.int64, device=strategy.device)
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        differ = (both[:len(names)] != -both[len(names):]).nonzero().flatten().tolist()
        if differ:
            findings.append(_who_differs(group, dim, [names[i] for i in differ], mine[differ]))
    flag = torch.tensor([len(findings)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group())  # every rank stops, or none
    if int(flag) == 0:
        return
    everyone = [None] * strategy.env.world_size
    dist.all_gather_object(everyone, findings, group=control_group())
    seen = list(dict.fromkeys(f for per_rank in everyone for f in per_rank))
    raise ReplicaMismatch(f"replicas disagree at step {step}: " + "; ".join(seen), last_snapshot)


def _who_differs(group, dim: str, names: list[str], mine: torch.Tensor) -> str:
    """Which ranks of `group` hold a minority value of the first differing tensor (a flipped copy)."""
    size = dist.get_world_size(group)
    parts = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    values = [int(p[0]) for p in parts]
    counts = {v: values.count(v) for v in values}
    more = f" (and {len(names) - 1} more tensors)" if len(names) > 1 else ""
    majority = max(counts, key=counts.get)
    if list(counts.values()).count(counts[majority]) > 1:  # e.g. 2 replicas: no copy can be called the odd one
        ranks = " and ".join(str(dist.get_global_rank(group, i)) for i in range(size))
        return f"{names[0]}{more} differs between ranks {ranks} over the {dim} group (no majority copy)"
    odd = [dist.get_global_rank(group, i) for i, v in enumerate(values) if v != majority]
    return (f"{names[0]}{more} on rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} differs from "
            f"the other {size - len(odd)} replica{'s' if size - len(odd) > 1 else ''} over the {dim} group")
