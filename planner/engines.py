"""The data-parallel engines' costs: what each keeps per rank and what it moves per optimizer step.

One class per engine of `parallel.options.Engine`, each beside its formula. fp32 AdamW keeps 4
bytes of parameter, 4 of gradient and 8 of Adam state per element; with `a` parameters on n ranks
that is the ZeRO paper's (Rajbhandari et al. 2020):

    ddp          4a + 4a + 8a = 16a                (+4a of buckets with gradient_as_bucket_view=false)
    ZeRO-1       4a + 4a + 8a/n                    optimizer state sharded
    ZeRO-2       4a + 12a/n                        + gradients sharded
    ZeRO-3/FSDP  16a/n                             + parameters sharded

and for K bytes of gradients, per rank on a ring: all-reduce 2K(n-1)/n, reduce-scatter and
all-gather K(n-1)/n each. ddp all-reduces; ZeRO-1/2 reduce-scatter the gradients and all-gather
the updated slices (together an all-reduce's 2K(n-1)/n); ZeRO-3/FSDP also gathers every unit's
parameters again in backward: K(n-1)/n more, 3K(n-1)/n in all (without resharding after forward,
2K(n-1)/n). Each engine places elements as its code does: ZeRO-1/2 (parallel/zero_shard.py)
ceil(numel / n) elements of every flattened tensor, FSDP2 ceil(dim0 / n) rows.

Under context parallelism (parallel/cp.py) the cp ranks of a sequence hold the same parameters:
DDP and FSDP2 run over dp x cp flattened ("dp_cp", n = dp x cp ranks), as parallel/ddp.py and
parallel/fsdp.py build them. `engine_costs(layout, parallel_config)` picks the class; one data-parallel rank is `EngineCosts`
itself (nothing sharded, nothing moved).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from config import ParallelConfig
from parallel.options import Engine
from planner.inventory import ADAM_STATE_BYTES, PARAM_BYTES, RankTensors
from planner.records import Collective, PlannedLayout
from planner.units import ceil_div, numel

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def ring_volume(k: float, n: int) -> int:
    """Bytes one rank sends when a ring reduce-scatters or all-gathers K bytes over n ranks:
    K(n-1)/n (an all-reduce is both: pass 2K)."""
    return round(k * ((n - 1) / n))


@dataclass
class ModelState:
    """Parameters, gradients and Adam state on one rank (bytes), or in host memory when offloaded."""
    params: int
    grads: int
    optimizer: int
    host: int = 0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineCosts:
    """One replica per rank, nothing moved: `none`, `dp` (one process), or any engine at dp = 1.
    4a + 4a + 8a = 16a."""
    ranks: int  # the data-parallel ranks that shard (HSDP: the ranks of one replica group)
    microbatches: int  # forward/backwards per optimizer step on one rank
    group: str = "dp"  # where it runs: dp, or dp_cp (dp x cp flattened) under context parallelism
    shards_params: ClassVar[bool] = False
    shards_grads: ClassVar[bool] = False
    shards_state: ClassVar[bool] = False

    @classmethod
    def of(cls, lay: PlannedLayout, p: ParallelConfig) -> EngineCosts:
        return cls(lay.dp_shard, lay.microbatches, lay.engine_group)

    def share(self, shape: tuple[int, ...]) -> int:
        """One rank's elements of a tensor this engine shards: ZeRO-1/2's torch.chunk of the
        flattened tensor, ceil(numel / n)."""
        return ceil_div(numel(shape), self.ranks)

    def _elems(self, shape: tuple[int, ...], sharded: bool) -> int:
        return self.share(shape) if sharded and self.ranks > 1 else numel(shape)

    def model_state(self, held: RankTensors) -> ModelState:
        # a V-shape rank's second tied copy (not in the optimizer) drops its gradient once it is
        # added to the first's (parallel/pp.py sync_tied_grads)
        stepped = [t for t in held if t.in_optimizer]
        return ModelState(sum(self._elems(t.shape, self.shards_params) for t in held) * PARAM_BYTES,
                          sum(self._elems(t.shape, self.shards_grads) for t in stepped) * PARAM_BYTES,
                          sum(self._elems(t.shape, self.shards_state) for t in stepped) * ADAM_STATE_BYTES)

    def buffers(self, held: RankTensors) -> tuple[int, list[str]]:
        """Communication buffers at the peak (bytes) and what they are."""
        return 0, []

    def collectives(self, held: RankTensors) -> list[Collective]:
        """The data-parallel collectives of one optimizer step on this rank."""
        return []


@dataclass(frozen=True)
class DDPCosts(EngineCosts):
    """ddp: replicated, 16a; gradients all-reduced once per step, 2K(n-1)/n.
    gradient_as_bucket_view=false keeps the buckets beside the gradients: +4a."""
    separate_buckets: bool = False
    bucket_cap_bytes: float = 25 * 2**20

    @classmethod
    def of(cls, lay: PlannedLayout, p: ParallelConfig) -> DDPCosts:
        return cls(lay.grad_ranks, lay.microbatches, lay.engine_group, separate_buckets=not p.gradient_as_bucket_view,
                   bucket_cap_bytes=p.bucket_cap_mb * 2**20)

    def buffers(self, held: RankTensors) -> tuple[int, list[str]]:
        if not self.separate_buckets or self.ranks == 1:
            return 0, []
        return held.elems * PARAM_BYTES, ["DDP buckets beside the gradients (gradient_as_bucket_view=false): +4a"]

    def collectives(self, held: RankTensors) -> list[Collective]:
        k = held.elems * PARAM_BYTES
        # the reducer all-reduces each bucket as soon as its gradients are ready, during backward
        return [Collective("all-reduce", self.group, "gradients, once per step (no_sync while accumulating)",
                           k, ring_volume(2 * k, self.ranks), "2K(n-1)/n",
                           calls=max(1, ceil_div(k, int(self.bucket_cap_bytes))), overlaps=True)]


@dataclass(frozen=True)
class Zero1Costs(EngineCosts):
    """ZeRO-1: optimizer state sharded, 4a + 4a + 8a/n. Gradients reduce-scattered in the last
    micro-batch's backward, K(n-1)/n; updated slices all-gathered, K(n-1)/n."""
    bucket_cap_bytes: float = 25 * 2**20
    shards_state: ClassVar[bool] = True
    gradient_copies: ClassVar[int] = 1  # full-size gradient buffers of a bucket while it reduces
    bucket_note: ClassVar[str] = "gathered weights + this rank's slice"

    @classmethod
    def of(cls, lay: PlannedLayout, p: ParallelConfig) -> Zero1Costs:
        return cls(lay.grad_ranks, lay.microbatches, lay.engine_group, bucket_cap_bytes=p.bucket_cap_mb * 2**20)

    def buffers(self, held: RankTensors) -> tuple[int, list[str]]:
        if self.ranks == 1:
            return 0, []
        # stage 2 holds a bucket's full gradients and their packed copy while it reduces;
        # both stages gather a bucket's weights into one buffer (+ this rank's slice)
        bucket = largest_zero_bucket(held, self.bucket_cap_bytes)
        return ((self.gradient_copies * bucket + ceil_div(bucket, self.ranks)) * PARAM_BYTES,
                ["largest ZeRO bucket: " + self.bucket_note])

    def gradient_reduction(self, padded: int, buckets: int, tensors: int) -> Collective:
        k = padded * PARAM_BYTES
        return Collective("reduce-scatter", self.group, "gradients, in the last micro-batch's backward",
                          k, ring_volume(k, self.ranks), "K(n-1)/n", calls=buckets,
                          copied_tensors=tensors, copied_elems=padded)

    def collectives(self, held: RankTensors) -> list[Collective]:
        # every tensor is padded to n equal chunks of ceil(numel / n) (parallel/zero_shard.py): at
        # dp 512 the padding of a small GPT's tensors is 1.9% of its bytes (found by the dry run's
        # sweep, benchmarks/dry_run_sweep.py)
        padded = sum(self.share(t.spec.shape) for t in held) * self.ranks
        k, buckets, tensors = padded * PARAM_BYTES, zero_buckets(held, self.bucket_cap_bytes), len(held.tensors)
        # each call packs its bucket's tensors and unpacks what it receives (parallel/zero_shard.py)
        return [self.gradient_reduction(padded, buckets, tensors),
                Collective("all-gather", self.group, "updated parameter slices", k, ring_volume(k, self.ranks), "K(n-1)/n",
                           calls=buckets, copied_tensors=tensors, copied_elems=padded)]


@dataclass(frozen=True)
class Zero2Costs(Zero1Costs):
    """ZeRO-2: + gradients sharded, 4a + 12a/n. Gradients reduce-scattered on every micro-batch,
    m K(n-1)/n; updated slices all-gathered, K(n-1)/n."""
    shards_grads: ClassVar[bool] = True
    gradient_copies: ClassVar[int] = 2
    bucket_note: ClassVar[str] = "its full gradients + packed copy + slice"

    def gradient_reduction(self, padded: int, buckets: int, tensors: int) -> Collective:
        m, k = self.microbatches, padded * PARAM_BYTES
        return Collective("reduce-scatter", self.group, f"gradients on each of {m} micro-batch(es)",
                          k * m, ring_volume(k * m, self.ranks), "m K(n-1)/n", calls=buckets * m,
                          copied_tensors=tensors * m, copied_elems=padded * m)


def zero_bucket_sizes(held: RankTensors, cap_bytes: float) -> list[int]:
    """Buckets of parallel/zero_shard.py in elements: decay (matrices) then no-decay tensors,
    reversed, a bucket closes once it reaches bucket_cap_mb."""
    order = [t for t in held if len(t.shape) >= 2] + [t for t in held if len(t.shape) < 2]
    sizes, size = [], 0
    for t in reversed(order):
        size += t.elems
        if size * PARAM_BYTES >= cap_bytes:
            sizes, size = sizes + [size], 0
    return sizes + [size] if size else sizes


def largest_zero_bucket(held: RankTensors, cap_bytes: float) -> int:
    return max(zero_bucket_sizes(held, cap_bytes), default=0)


def zero_buckets(held: RankTensors, cap_bytes: float) -> int:
    return max(1, len(zero_bucket_sizes(held, cap_bytes)))


@dataclass(frozen=True)
class FullyShardCosts(EngineCosts):
    """ZeRO-3 and fsdp (FSDP2 fully_shard): everything sharded, 16a/n, as ceil(dim0 / n) rows.
    Per micro-batch every unit is all-gathered in forward and again in backward, 2K(n-1)/n (once
    without reshard_after_forward), and the gradients reduce-scattered once per step, K(n-1)/n:
    3K(n-1)/n against ZeRO-1/2's 2K(n-1)/n. HSDP (fsdp, R replica groups of S ranks): the same
    within a group of S, then the reduced shards all-reduced over R, 2(K/S)(R-1)/R."""
    replicas: int = 1
    reshard_after_forward: bool = True
    pipelined: bool = False  # pp > 1: torch's stages keep their parameters gathered between backwards
    gathered_bytes: int = PARAM_BYTES  # bytes per gathered element (fsdp mixed_precision: 2)
    reduce_bytes: int = PARAM_BYTES  # bytes per reduced gradient element (fsdp reduce_dtype)
    cpu_offload: bool = False
    shards_params: ClassVar[bool] = True
    shards_grads: ClassVar[bool] = True
    shards_state: ClassVar[bool] = True

    @classmethod
    def of(cls, lay: PlannedLayout, p: ParallelConfig) -> FullyShardCosts:
        fsdp = lay.strategy is Engine.FSDP  # zero-3 is FSDP2 with its defaults
        mixed = fsdp and p.mixed_precision != "none"
        return cls(lay.dp_shard, lay.microbatches, lay.engine_group, replicas=lay.dp_replicate,
                   reshard_after_forward=lay.reshard_after_forward, pipelined=lay.pp > 1,
                   gathered_bytes=2 if mixed else PARAM_BYTES,  # FSDP2 all-gathers in param_dtype
                   reduce_bytes=DTYPE_BYTES[p.reduce_dtype] if fsdp else PARAM_BYTES,
                   cpu_offload=fsdp and p.cpu_offload)

    def share(self, shape: tuple[int, ...]) -> int:
        """FSDP2: dim-0 chunks, padded to ceil(dim0 / n) rows on every rank."""
        return ceil_div(shape[0], self.ranks) * numel(shape[1:])

    def model_state(self, held: RankTensors) -> ModelState:
        state = super().model_state(held)
        if not self.cpu_offload or self.ranks == 1:
            return state
        return ModelState(0, 0, 0, host=state.params + state.grads + state.optimizer,
                          notes=("cpu_offload: sharded parameters, gradients and Adam state live in host memory",))

    def buffers(self, held: RankTensors) -> tuple[int, list[str]]:
        """Root (embeddings, head) gathered at the loss and the first backward, two blocks gathered
        (current + prefetch) or, without resharding or under pp, all of the stage's, and two
        blocks of unsharded gradients; gradient accumulation keeps the whole unsharded gradient."""
        if self.ranks == 1:
            return 0, []
        block = held.largest_block_elems
        # torch's pipeline stages keep FSDP parameters gathered after every backward but the
        # last (PipelineStage: set_reshard_after_backward(False)), so a stage's blocks can all
        # be gathered at once; without pp two blocks are (the current one and the prefetch)
        whole = not self.reshard_after_forward or self.pipelined
        kept = held.block_elems if whole else 2 * block
        total = (held.root_elems + kept) * self.gathered_bytes + 2 * block * self.reduce_bytes
        notes = []
        if self.microbatches > 1:
            total += held.elems * PARAM_BYTES
            notes.append("FSDP2 keeps unsharded gradients across the accumulated micro-batches")
        notes.append("FSDP2: root (embeddings, head) gathered at the loss and the first backward; "
                     + ("every block of the stage may be gathered at once" if whole else "two blocks gathered at a time"))
        return total, notes

    def collectives(self, held: RankTensors) -> list[Collective]:
        out = self._within_group(held) if self.ranks > 1 else []
        if self.replicas > 1:  # HSDP: the reduced shards are all-reduced across the replica groups
            reps = self.replicas
            # each rank's padded FSDP2 shard (found by the dry run: HSDP of 8 x 128 at 1,024 ranks)
            ar = sum(self.share(t.shape) for t in held) * self.reduce_bytes
            out.append(Collective("all-reduce", "dp_replicate", "gradient shards across the replica groups",
                                  ar, round(2 * ar * (reps - 1) / reps), "2(K/s)(R-1)/R",
                                  calls=held.blocks + 1, overlaps=True))
        return out

    def _within_group(self, held: RankTensors) -> list[Collective]:
        # parallel/fsdp.py passes reshard_after_forward to the root too, which turns off torch's
        # keep-the-root-gathered default (only for reshard_after_forward=None): with resharding,
        # the root (embeddings, ln_f, head) is gathered again in backward like every block
        # (measured: benchmarks/strategy_report.py, 2 x 8 blocks + 2 root all-gathers)
        gathers = 2 if self.reshard_after_forward else 1
        group = "dp_shard" if self.replicas > 1 else self.group
        # FSDP2 moves padded dim-0 chunks, ceil(dim0 / s) rows on each of s ranks (at dp 64 the
        # small tensors' padding is 3.7% of a GPT's bytes: found by the dry run, tools/dry_run.py)
        padded = sum(self.share(t.shape) for t in held) * self.ranks
        units = held.blocks + 1  # fully_shard per block + the root
        ag = gathers * padded * self.gathered_bytes * self.microbatches
        ag_calls, upper = units * gathers * self.microbatches, ""
        if self.pipelined and self.reshard_after_forward:
            # torch's stages gather for every forward and once for the backwards (they stay
            # gathered between backwards): (m + 1) K, measured by the dry run at 512 ranks (1f1b)
            ag, gathers, upper = (self.microbatches + 1) * padded * self.gathered_bytes, 0, " (pp: m forwards + 1 backward)"
            ag_calls = units * (self.microbatches + 1)
        rs = padded * self.reduce_bytes
        what = f"{gathers}x (forward{' + backward' if gathers == 2 else ''}) per micro-batch" if gathers else ""
        # prefetched one unit ahead and reduced on FSDP2's own streams: both overlap compute
        return [Collective("all-gather", group, f"parameters, blocks and root: {what}{upper}",
                           ag, ring_volume(ag, self.ranks), f"m {gathers}K(s-1)/s" if gathers else "(m+1)K(s-1)/s",
                           calls=ag_calls, overlaps=True),
                Collective("reduce-scatter", group, "gradients once per step", rs, ring_volume(rs, self.ranks),
                           "K(s-1)/s", calls=units, overlaps=True)]


COSTS: dict[Engine, type[EngineCosts]] = {
    Engine.DDP: DDPCosts, Engine.ZERO1: Zero1Costs, Engine.ZERO2: Zero2Costs,
    Engine.ZERO3: FullyShardCosts, Engine.FSDP: FullyShardCosts,
}


def engine_costs(lay: PlannedLayout, p: ParallelConfig) -> EngineCosts:
    """The costs of the layout's data-parallel engine (NONE and DP: one replica, nothing moved)."""
    return COSTS.get(lay.strategy, EngineCosts).of(lay, p)
