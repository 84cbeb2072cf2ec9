"""The planner's records: what a layout is (`PlannedLayout`), what it costs on one rank
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

from parallel.options import Engine


@dataclass
class PlannedLayout:
    strategy: Engine  # NONE with one data-parallel rank: every engine leaves the model as it is
    dp: int
    tp: int
    pp: int
    pp_schedule: str  # "" when pp == 1
    stages_per_rank: int
    micro_batch_size: int  # sequences per forward/backward on one rank
    microbatches: int  # forward/backwards per optimizer step on one rank (pipeline M or accumulation)
    activation_checkpointing: bool
    sequence_parallel: bool
    tp_vocab_parallel: bool
    reshard_after_forward: bool  # fsdp's option; zero-3 always reshards; False for the others
    stage_blocks: tuple[int, ...]  # transformer blocks per pipeline stage (parallel.layout.Layout)
    stage_placement: tuple[int, ...]  # stage -> pp rank
    dp_replicate: int = 1  # HSDP (fsdp): replica groups; FSDP2 shards over dp / dp_replicate ranks

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def name(self) -> str:
        keep = " no-reshard" if self.strategy is Engine.FSDP and not self.reshard_after_forward else ""
        label = "hsdp" if self.dp_replicate > 1 else self.strategy.value
        shape = f"{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"{self.dp}"
        parts = [f"{label}{keep} dp{shape}" if self.dp > 1 else "dp1"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else "")
                         + ("+vocab" if self.tp_vocab_parallel else ""))
        if self.pp > 1:
            v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"pp{self.pp} {self.pp_schedule}{v}")
        return " x ".join(parts)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The pipeline stages placed on `pp_rank` (loop: one, interleaved: v, ZB-V: r and S-1-r)."""
        return [s for s, rank in enumerate(self.stage_placement) if rank == pp_rank]

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)


@dataclass
class Collective:
    """One kind of collective a layout issues per optimizer step (per rank, ring volumes)."""
    kind: str  # all-reduce | reduce-scatter | all-gather | send-recv | tp
    group: str  # dp | dp_shard | dp_replicate | tp | pp | tied (first + last pipeline stage)
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
    peak: int
    notes: list[str] = field(default_factory=list)


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
            rec["layout"]["name"] = lp.layout.name
        return json.dumps(record, indent=1)
