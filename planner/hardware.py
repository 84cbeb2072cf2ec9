"""The hardware a step time is predicted for: `--hardware NAME|FILE`.

A `Hardware` is one node's per-device figures: peak FLOP/s per dtype, memory, memory bandwidth,
the two link classes a collective can run on (inside a node: NVLink; across nodes: the network,
per device) with a latency per ring step and a bandwidth in one direction, the devices per node,
and the fraction of the peak the model's forward and backward reach. Shipped descriptions are
YAML files in planner/hardware/ (each figure beside the URL it comes from); `local` is this
machine, measured once and cached (tools/calibrate.py, read by planner/local_hardware.py). A name that is neither, or a file that
is not a complete description, is one line and exit 2.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from config import UsageError
from planner.local_hardware import local_figures
from planner.units import parse_bytes

HARDWARE_DIR = Path(__file__).resolve().parent / "hardware"
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one device sends in one direction
    latency: float  # seconds per ring step (alpha of the alpha-beta model)
    # seconds per ring step of a call right after the rank's previous one, where the latency
    # depends on the compute since then (Hardware.latency_gap; gloo on a CPU: its threads sleep
    # when idle); None: the same latency after any gap
    near_latency: float | None = None


@dataclass(frozen=True)
class Hardware:
    name: str
    source: str  # the file, or how `local` was measured
    devices_per_node: int  # ranks per node (CPU: one single-threaded process per core)
    memory: int  # bytes per device
    peak_flops: dict[str, float]  # dense FLOP/s per device, per trainer.precision dtype
    memory_bandwidth: float  # bytes/s (the optimizer step streams the model state through it)
    intra_node: Link
    inter_node: Link
    compute_efficiency: float  # fraction of the peak the model's forward/backward reach
    block_overhead: float = 0.0  # seconds per block per micro-batch (forward + backward) of fixed cost
    # seconds per block per micro-batch a tensor-parallel / FSDP2-sharded block pays beyond a plain
    # block's fixed cost: the engine's host work (DTensor dispatch, hooks, copy-in/out)
    tp_overhead: float = 0.0
    fsdp_overhead: float = 0.0
    sp_overhead: float = 0.0  # what sequence parallelism's redistributions add to a tp block's
    # seconds per optimizer step of fixed work outside the blocks: the embedding, head and loss, the
    # clip, the optimizer's per-tensor work, zero_grad
    step_overhead: float = 0.0
    # seconds per activation element (token x width) per block per micro-batch, forward + backward:
    # the element-wise work (LayerNorms, GELU, softmax, residual and bias adds) beside the matmuls,
    # which compute_efficiency prices alone where this is given (local measures both: tools/calibrate.py)
    elementwise: float = 0.0
    # collectives run beside compute on their own engine (a GPU: NCCL's kernels, copy engines); False
    # on a CPU, whose cores do a collective's copies and sums themselves: nothing is hidden
    overlap: bool = True
    # every rank of the job runs on this one machine (`local`): ranks beyond devices_per_node share
    # its cores, each computing at devices_per_node / world of one (planner/timing.py)
    shared_node: bool = False
    # the backend has no ring reduce-scatter and runs it as an all-reduce (gloo: twice the bytes and
    # ring steps; measured by benchmarks/bytes_per_strategy.py). The project's ZeRO and FSDP2 plug in
    # their own ring (parallel/collectives.py); DTensor's sequence parallelism does not, so its
    # reduce-scatters pay it (planner/timing.py)
    reduce_scatter_as_all_reduce: bool = False
    # how much slower one device computes while every device of its node computes too (>= 1): CPU
    # cores share the memory system and caches (local measures it with 2 processes); a GPU's own
    # HBM is its own, 1
    busy_node_slowdown: float = 1.0
    # a backend whose all-gather and reduce-scatter do not run at the rates of its all-reduce's ring
    # steps (gloo: a 4 KB all-gather 2.4 ms where a ring step of its all-reduce is 0.9 ms;
    # benchmarks/collective_rates.py) gives their own latency per ring step and bandwidth, used for
    # the data-parallel engines' gathers and reduce-scatters inside a node; None: the link's
    gather_link: Link | None = None
    scatter_link: Link | None = None
    # what torch's split backward (the zero-bubble schedules' input and weight halves: a walk of the
    # autograd graph, then one autograd call per parameter group) costs beyond one full backward:
    # seconds per block per micro-batch, and per activation element per block (local measures both:
    # tools/calibrate.py split_rates, timed through torch's own schedules; about 0.7 ms a block at
    # 64 wide x 256 tokens on a 2-core CPU, where the full backward takes 1.2 ms). Absent: 0, not priced
    split_backward_overhead: float = 0.0
    split_backward_elementwise: float = 0.0
    # what FSDP2 costs per parameter element it shards, per micro-batch, beyond fsdp_overhead's fixed
    # cost per block: the copy-in to the all-gather buffer and the copy-out to the unsharded
    # parameters (forward and backward), the gradients' chunk-cat into the reduce-scatter buffer
    # (local measures it on the fake process group: tools/calibrate.py). Absent: 0, not priced
    fsdp_copy: float = 0.0
    # seconds per parameter tensor per optimizer step that AdamW's fused kernel on DTensor shards
    # (FSDP2) costs beyond the same kernel on plain tensors: DTensor's dispatch of each tensor list.
    # Absent: 0, not priced
    dtensor_optimizer_overhead: float = 0.0
    # the compute (seconds) each call followed where the links' `latency` was measured; a call after
    # less compute since the rank's previous call pays between the link's near_latency and it, in
    # proportion (planner/timing.py). local measures both ends: on the 2-core CPU a 4 KB gloo
    # call's mean grows with the compute before it (its threads and the peer's fall asleep). 0: every
    # call pays the link's `latency`
    latency_gap: float = 0.0
    # what context parallelism's attention (parallel/cp.py, per parallel.cp_mode) costs per block per
    # micro-batch beyond one fused attention over the same query-key pairs: its blocks of the kernel,
    # the log-sum-exp merges, the chunks' slicing; a fixed part and one per activation element
    # (tokens x width / tp per block). local measures them on the fake process group
    # (tools/calibrate_engines.py). Absent: 0, not priced
    cp_ring_overhead: float = 0.0
    cp_ring_elementwise: float = 0.0
    cp_allgather_overhead: float = 0.0
    cp_allgather_elementwise: float = 0.0
    # seconds per call that FSDP2's own all-gathers and reduce-scatters cost at least, beyond their
    # bytes, measured in FSDP2's pattern on the backend (local: a 2-rank FSDP2 GPT's forward +
    # backward on gloo, less the same on the fake process group, per call: tools/calibrate.py). On
    # the 2-core CPU about a ms a call even with little compute between calls, where a call right
    # after another measures 0.15-1.0 ms. Absent: 0, FSDP2's calls priced like any other
    fsdp_call_latency: float = 0.0
    # seconds per byte a rank sends in FSDP2's own all-gathers and reduce-scatters inside a node,
    # measured in FSDP2's pattern on the backend with fsdp_call_latency (local: a wide 2-rank FSDP2 GPT
    # beside the tiny one, tools/calibrate_engines.py fsdp_call_costs). On the 2-core CPU 0.93-1.89 ns
    # (median 1.30) in 40 calibrations, where gloo's all-gather and all-to-all timed alone in the same
    # calibrations moved 0.96-1.65 and 1.3-2.7 GB/s (0.6-1.0 and 0.4-0.8 ns a byte).
    # Absent: 0, FSDP2's bytes priced at the links' bandwidths like any other call's
    fsdp_byte_time: float = 0.0
    # what the project's ZeRO-1/2 engine (parallel/zero_shard.py) costs the rank's cores around each
    # of its reduce-scatters and all-gathers: seconds per tensor of the bucket (a pad and a slice
    # each) and per element (packed into one buffer before the call; after it the received rows
    # summed and divided, or split and copied into the parameters). local measures both on the
    # fake process group (tools/calibrate_engines.py; 5.6-6.4 us and 0.69-0.90 ns in 24 calibrations
    # on the 2-core CPU).
    # Absent: no fixed part, and each element priced as ZERO_COPY_BYTES over memory_bandwidth
    # (planner/timing.py engine_copies)
    zero_overhead: float = 0.0
    zero_copy: float = 0.0
    # seconds per activation element (token x width) per block per micro-batch that sequence
    # parallelism's redistributions cost beyond plain tp's work, with sp_overhead's fixed part per
    # block (local measures both on the fake process group: tools/calibrate_engines.py). Absent: 0
    sp_elementwise: float = 0.0
    # seconds per matmul weight element per micro-batch: what each matmul call costs for its weight
    # whatever its rows (the kernel packs the weight, or streams it from memory, once per call: one
    # call in forward, two in backward). Per optimizer step it grows with the micro-batches at the
    # same FLOPs: on the 2-core CPU a 4-block stack's 512 tokens as 8 micro-batches against 1 paid,
    # per block per extra micro-batch, 0.22 ms at 64 wide, 0.76 at 256, 1.69 at 384 and 3.21 at 512:
    # a fixed part and 0.73 ns a weight element between 64 and 256 wide, 1.04 between 256 and 512
    # (2026-11-29; 0.57-1.58 ns in the 40 calibrations of docs/grid-n2-x5-weightpass). local
    # measures it (tools/calibrate.py weight_pass_rate). Absent: 0, not priced
    weight_pass: float = 0.0
    # seconds per micro-batch that tensor parallelism's vocabulary-parallel embedding, LM head and
    # loss_parallel cross-entropy cost the host beyond the replicated ones (DTensor's dispatch of the
    # masked lookup, the sharded logits' max, sum of exponentials and target logit), once a step per
    # micro-batch whatever the blocks: on the fake process group at tp 2, 1.0-3.4 ms by hand at
    # 64-256 wide over 32-2,048 tokens, 0.28-1.69 ms in the 40 calibrations of
    # docs/grid-n2-x5-vocab (2026-11-29). local measures it (tools/calibrate_engines.py). Absent: 0
    vocab_overhead: float = 0.0

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype) or self.peak_flops["fp32"]


# the Hardware fields a description may leave out (absent: 0, not priced), each a cost in seconds
# (fixed, or per element) or latency_gap's seconds of compute; read by name
OPTIONAL_COSTS = tuple(f.name for f in dataclasses.fields(Hardware) if f.type in ("float", float) and f.default == 0.0)


def shipped_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(spec: str, precision: str = "fp32", measure: Callable[[], dict] | None = None) -> Hardware:
    """`local` (this machine, as cached by tools/calibrate.py; `measure`, e.g. its measure_local,
    runs when nothing is cached, else the UNCALIBRATED figures: planner/local_hardware.py), a
    shipped name (planner/hardware/NAME.yaml) or a YAML file; UsageError otherwise."""
    if spec == "local":
        return hardware_of(local_figures(precision, measure), "local")
    path = HARDWARE_DIR / f"{spec}.yaml" if spec in shipped_names() else Path(spec).expanduser()
    if not path.is_file():
        raise UsageError(f"--hardware '{spec}' is neither local, a shipped description "
                         f"({', '.join(shipped_names())}) nor a file; give one of those or a YAML file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UsageError(f"--hardware file '{spec}' cannot be read as YAML ({type(e).__name__}); "
                         f"fix it (planner/hardware/*.yaml shows the format)") from None
    return hardware_of(raw, str(path))


def _number(raw: dict, key: str, where: str) -> float:
    try:
        value = float(raw[key])
    except (KeyError, TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"--hardware file '{where}' needs {key}: a positive number "
                         f"(got {raw.get(key) if isinstance(raw, dict) else raw!r}); planner/hardware/*.yaml shows the format")
    return value


def hardware_of(raw, where: str) -> Hardware:
    """A Hardware from a parsed YAML description; UsageError naming the first bad key."""
    if not isinstance(raw, dict):
        raise UsageError(f"--hardware file '{where}' must be a mapping of keys; planner/hardware/*.yaml shows the format")
    peaks = raw.get("peak_flops")
    if not isinstance(peaks, dict) or "fp32" not in peaks:
        raise UsageError(f"--hardware file '{where}' needs peak_flops with at least fp32 (and bf16, fp16): "
                         f"FLOP/s per device")
    links = {key: _link(raw, key, where) for key in ("intra_node", "inter_node")}
    # optional: a backend's all-gather and reduce-scatter at their own rates
    links |= {key: _link(raw, key, where) if raw.get(key) is not None else None
              for key in ("all_gather_link", "reduce_scatter_link")}
    efficiency = _number(raw, "compute_efficiency", where)
    if efficiency > 1:
        raise UsageError(f"--hardware file '{where}': compute_efficiency {efficiency} is a fraction of the peak; give <= 1")
    return Hardware(str(raw.get("name") or Path(where).stem), str(raw.get("source") or where), int(_number(raw, "devices_per_node", where)),
                    parse_bytes(str(raw.get("memory")), f"--hardware file '{where}' memory"),
                    {k: _number(peaks, k, where) for k in DTYPES if k in peaks},
                    _number(raw, "memory_bandwidth", where), links["intra_node"], links["inter_node"],
                    efficiency, overlap=_flag(raw, "overlap", where, True), shared_node=_flag(raw, "shared_node", where, False),
                    reduce_scatter_as_all_reduce=_flag(raw, "reduce_scatter_as_all_reduce", where, False),
                    busy_node_slowdown=_slowdown(raw, where), gather_link=links["all_gather_link"],
                    scatter_link=links["reduce_scatter_link"], **{key: _optional(raw, key, where) for key in OPTIONAL_COSTS})


def _link(raw: dict, key: str, where: str) -> Link:
    link = raw.get(key)
    if not isinstance(link, dict):
        raise UsageError(f"--hardware file '{where}' needs {key}: {{bandwidth: bytes/s, latency: seconds}}")
    near = _number(link, "near_latency", where) if link.get("near_latency") is not None else None
    return Link(_number(link, "bandwidth", where), _number(link, "latency", where), near)


def _flag(raw: dict, key: str, where: str, absent: bool) -> bool:
    value = raw.get(key, absent)
    if not isinstance(value, bool):
        raise UsageError(f"--hardware file '{where}': {key} must be true or false (got {value!r})")
    return value


def _slowdown(raw: dict, where: str) -> float:
    """busy_node_slowdown: a factor >= 1, absent is 1."""
    if "busy_node_slowdown" not in raw:
        return 1.0
    value = _number(raw, "busy_node_slowdown", where)
    if value < 1:
        raise UsageError(f"--hardware file '{where}': busy_node_slowdown {value} is a slowdown factor; give >= 1")
    return value


def _optional(raw: dict, key: str, where: str) -> float:
    """An optional cost in seconds (fixed, or per element): absent is 0 (a GPU's host work overlaps its kernels)."""
    return _number(raw, key, where) if raw.get(key) else 0.0
