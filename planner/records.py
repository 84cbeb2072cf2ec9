"""The planner's records: what a layout is (`PlannedLayout`: the launch's own Layout and the options that
price it), what it costs on one rank
(`RankMemory`) and on the wire (`Collective`), one layout's prediction (`LayoutPlan`) and the
whole `--plan` answer (`Plan`).

Every record is a dataclass that `dataclasses.asdict` turns into JSON (`--plan-json`), so a
report that measures layouts can put its numbers next to these. The data-parallel engine is a
`parallel.options.Engine`, a str Enum: it is written to JSON as its name ("zero-1").
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from parallel.layout import Layout
from parallel.options import Engine


@dataclass
class PlannedLayout:
    """A layout as the planner prices it: the launch's own `Layout` (parallel/layout.py: the
    degrees, the batch split, the pipeline stages and their placement, computed by Layout.of) and
    the engine and options that change what it costs."""
    shape: Layout
    strategy: Engine  # NONE with one data-parallel rank: every engine leaves the model as it is
    pp_schedule: str  # "" when pp == 1
    activation_checkpointing: bool
    sequence_parallel: bool
    tp_vocab_parallel: bool
    reshard_after_forward: bool  # fsdp's option; zero-3 always reshards; False for the others
    cp_mode: str = ""  # parallel.cp_mode (ring | allgather) when cp > 1

    # what Layout says, by the names the cost formulas use
    dp = property(lambda self: self.shape.dp)
    tp = property(lambda self: self.shape.tp)
    pp = property(lambda self: self.shape.pp)
    micro_batch_size = property(lambda self: self.shape.micro_batch_size)  # sequences per forward/backward
    microbatches = property(lambda self: self.shape.microbatches)  # forward/backwards per step on one rank
    stage_blocks = property(lambda self: tuple(self.shape.stage_blocks))  # transformer blocks per stage
    stage_placement = property(lambda self: tuple(self.shape.stage_placement))  # stage -> pp rank
    num_stages = property(lambda self: self.shape.num_stages)
    stages_per_rank = property(lambda self: self.shape.num_stages // self.shape.pp)
    world = property(lambda self: self.shape.world_size)
    cp = property(lambda self: self.shape.cp)  # context parallel: ranks each sequence is split over

    @property
    def grad_ranks(self) -> int:
        """The ranks the data-parallel engine averages (and shards) over: dp, or dp x cp flattened
        under context parallelism (the cp ranks of a sequence hold the same parameters)."""
        return self.dp * self.cp

    @property
    def engine_group(self) -> str:
        """The planner's name of that group (parallel/layout.py Layout.grad_dim)."""
        return self.shape.grad_dim

    @property
    def dp_replicate(self) -> int:
        """HSDP's replica groups (fsdp): FSDP2 shards over dp / dp_replicate ranks; 1 otherwise."""
        return self.shape.dp_replicate if self.strategy is Engine.FSDP else 1

    @property
    def dp_shard(self) -> int:
        return self.grad_ranks // self.dp_replicate

    def stages_of(self, pp_rank: int) -> list[int]:
        """The pipeline stages placed on `pp_rank` (loop: one, interleaved: v, ZB-V: r and S-1-r)."""
        return self.shape.stages_of(pp_rank)

    @property
    def name(self) -> str:
        keep = " no-reshard" if self.strategy is Engine.FSDP and not self.reshard_after_forward else ""
        label = "hsdp" if self.dp_replicate > 1 else self.strategy.value
        shape = f"{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"{self.dp}"
        parts = [f"{label}{keep} dp{shape}" if self.grad_ranks > 1 else "dp1"]  # cp: the engine acts at dp 1
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else "")
                         + ("+vocab" if self.tp_vocab_parallel else ""))
        if self.pp > 1:
            v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"pp{self.pp} {self.pp_schedule}{v}")
        if self.cp > 1:
            parts.append(f"cp{self.cp} {self.cp_mode}")
        return " x ".join(parts)

    def to_record(self) -> dict:
        """The layout as --plan-json writes it (one flat record, the name last)."""
        return {"strategy": self.strategy, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "pp_schedule": self.pp_schedule, "stages_per_rank": self.stages_per_rank,
                "micro_batch_size": self.micro_batch_size, "microbatches": self.microbatches,
                "activation_checkpointing": self.activation_checkpointing,
                "sequence_parallel": self.sequence_parallel, "tp_vocab_parallel": self.tp_vocab_parallel,
                "reshard_after_forward": self.reshard_after_forward, "stage_blocks": list(self.stage_blocks),
                "stage_placement": list(self.stage_placement), "dp_replicate": self.dp_replicate,
                "cp": self.cp, "cp_mode": self.cp_mode, "name": self.name}


@dataclass
class Collective:
    """One kind of collective a layout issues per optimizer step (per rank, ring volumes)."""
    kind: str  # all-reduce | reduce-scatter | all-gather | send-recv | tp | cp
    group: str  # dp | dp_shard | dp_replicate | dp_cp | tp | pp | cp | tied (first + last pipeline stage)
    what: str
    payload_bytes: int  # K: bytes handed to one call, summed over the calls of one step
    moved_bytes: int  # what one rank sends per step on a ring
    formula: str
    calls: int = 1  # calls per optimizer step (each pays the link's latency per ring step)
    overlaps: bool = False  # issued while compute goes on (planner/timing.py says which and why)
    # of a "tp" record: the calls and moved bytes that are reduce-scatters (sequence parallelism's),
    # which a backend without a ring reduce-scatter runs as all-reduces (Hardware.reduce_scatter_as_all_reduce)
    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0
    # of a "cp" record in allgather mode (the rest are reduce-scatters) or a "tp" record under
    # sequence parallelism (DTensor's Shard(1) -> Replicate): the calls and moved bytes that are
    # all-gathers, priced at the backend's own all-gather rates where the hardware gives them (gloo's)
    gather_calls: int = 0
    gather_bytes: int = 0
    # tensors and elements the engine's own code packs before its calls and unpacks after them,
    # summed over the step's calls (ZeRO-1/2, parallel/zero_shard.py: every tensor of a bucket padded
    # and concatenated, the received rows summed or split and copied back): a rank's cores do it,
    # priced by planner/timing.py engine_copies
    copied_tensors: int = 0
    copied_elems: int = 0


@dataclass
class RankMemory:
    """Predicted bytes on one rank (the fullest rank of its pipeline stage group)."""
    pp_rank: int
    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward, all micro-batches in flight
    activations_per_microbatch: int  # this rank's stages, one micro-batch each
    inflight_microbatches: float  # activations / activations_per_microbatch (schedule-dependent)
    transient: int  # live at the peak but not saved: logits at the loss, a recomputed block
    buffers: int  # communication buffers: gathered FSDP parameters, unsharded grads, buckets
    host: int  # bytes kept in host memory instead (fsdp cpu_offload)
    peak: int  # the step's peak, or construction's where that is higher
    notes: list[str] = field(default_factory=list)
    construction: int = 0  # on the device while the model is built and loaded (planner/layout_plan.py)
    construction_host: int = 0  # in host memory then: the largest whole initial value (a CPU: + construction)


@dataclass
class TimeTerm:
    """One term of a predicted step time (planner/timing.py): its seconds, and the part of them the
    step waits for (overlapped communication is hidden behind compute up to the compute's length)."""
    name: str
    seconds: float
    exposed: float
    formula: str


@dataclass
class StepTime:
    """A layout's predicted optimizer step on one `Hardware` (planner/hardware.py)."""
    hardware: str
    step_s: float  # the sum of the terms' exposed seconds
    tokens_per_s: float
    mfu: float  # model FLOPs (6N + 12Lhs per token, no recomputation) / (peak x ranks)
    terms: list[TimeTerm]


@dataclass
class LayoutPlan:
    name: str
    configured: bool
    layout: PlannedLayout
    memory: RankMemory  # the rank with the highest peak
    per_pp_rank: list[RankMemory]
    collectives: list[Collective]
    moved_bytes_per_rank: dict[str, int]  # by kind, the busiest rank
    moved_bytes_total: int  # all ranks together per optimizer step
    fits: bool | None  # None when no --device-memory was given
    bubble: float  # (p-1)/(m+p-1) for gpipe/1f1b; interleaved: (p-1)/(v*m+p-1)
    time: StepTime | None = None  # None without a hardware description
    aliases: list[str] = field(default_factory=list)  # other names of the same layout (zero-3 = fsdp)
    # cp > 1: forward attention FLOPs per step of each cp rank (planner/compute.py attention_flops)
    attention_flops_per_cp_rank: list[int] = field(default_factory=list)


@dataclass
class Plan:
    world_size: int
    device_memory: int | None
    model: dict
    configured_error: str  # why the configured layout cannot run on world_size ("" if it can)
    layouts: list[LayoutPlan]
    refused: dict[str, str]  # alternative layout -> the one-line reason it was left out
    reserve: int = 0  # bytes of device memory kept for the runtime: a layout fits in device_memory - reserve
    hardware: str = ""  # the Hardware's name and source the times are for ("" = no times)
    advice: list[str] = field(default_factory=list)  # nothing fits: which knobs make what fit

    def to_json(self) -> str:
        record = dataclasses.asdict(self)
        for lp, rec in zip(self.layouts, record["layouts"]):
            rec["layout"] = lp.layout.to_record()
        return json.dumps(record, indent=1)
