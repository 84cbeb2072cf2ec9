"""Predict what a parallel layout costs before any process is launched: `python main.py --plan`.

Owns `plan(cfg, world_size, device_memory)`, which returns a `Plan`: one `LayoutPlan` record per
layout (the configured one first, then every alternative that `config.validate` and the
strategies' own `validate_layout` accept for the world size), each with the predicted per-rank
bytes of parameters, gradients, optimizer state, activations, transients and communication
buffers, and the bytes each collective moves per optimizer step. Pure arithmetic on the config:
no process group, no tensors. Every record is a dataclass that `dataclasses.asdict` turns into
JSON (`--plan-json`), so a report that measures layouts can put its numbers next to these.

Where the numbers come from (each is checked against measurement in tests/test_planner.py):
- Parameters: the shapes of model.py's GPT (`parameter_inventory`), placed by the same rules as
  parallel/: pipeline stages of parallel.layout.Layout (the tied embedding/head keeps a copy on the first
  and the last stage), Megatron column/row splits of parallel/tp.py (torch.chunk rows/columns),
  ZeRO-1/2 element slices of parallel/zero_shard.py (ceil(numel / n) per tensor) and FSDP2's dim-0
  shards (ceil(dim0 / n) rows per tensor). fp32 AdamW: parameters 4 bytes, gradients 4, state 8
  per element; with `a` parameters on n ranks that is the ZeRO paper's (Rajbhandari et al. 2020)
  16a (ddp), 4a + 4a + 8a/n (stage 1), 4a + 12a/n (stage 2), 16a/n (stage 3 / fsdp).
- Activations: the tensors autograd saves for backward in THIS model's forward, read off a
  measurement with torch.autograd.graph.saved_tensors_hooks; the per-block count is Korthikanti
  et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1:
  sbh(34 + 5as/h) bytes in 16-bit) adapted: SDPA's fused kernel keeps q, k, v, its output and a
  logsumexp instead of the 5as^2b attention matrices, and each term carries the dtype it really
  has (see `block_activation_bytes`).
- Bytes moved: a ring's volume per rank (all-reduce 2K(n-1)/n, reduce-scatter and all-gather
  K(n-1)/n for K bytes) for every collective the layout needs per optimizer step.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.pipelining import schedules

from config import Config, ParallelConfig, UsageError, validate
from model import GPTConfig
from parallel.layout import Layout

GPT2_VOCAB = 50257  # tiktoken r50k_base, the GPT-2 BPE (char_dataset.GPT2Tokenizer)
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
PARAM_BYTES = 4  # the model's parameters (and so their gradients) are fp32 under every precision
# what the alternatives put on the dp dimension; fsdp-keep = fsdp with reshard_after_forward=false
DP_STRATEGIES = ("ddp", "zero-1", "zero-2", "zero-3", "fsdp", "fsdp-keep")
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# ----------------------------------------------------------------------------- records


@dataclass
class ParamSpec:
    """One parameter tensor of model.py's GPT: name, shape, and how parallel/tp.py splits it."""
    name: str
    shape: tuple[int, ...]
    tp_style: str  # col (Shard(0)) | row (Shard(1) weight) | replicate | vocab (Shard(0) if vocab-parallel)
    where: str  # embed | block | head


@dataclass
class PlannedLayout:
    strategy: str  # none | dp | ddp | zero-1 | zero-2 | zero-3 | fsdp
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
    reshard_after_forward: bool
    stage_blocks: tuple[int, ...]  # transformer blocks per pipeline stage (parallel.layout.Layout)
    stage_placement: tuple[int, ...]  # stage -> pp rank
    dp_replicate: int = 1  # HSDP (fsdp): replica groups; FSDP2 shards over dp / dp_replicate ranks

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def name(self) -> str:
        keep = " no-reshard" if self.strategy == "fsdp" and not self.reshard_after_forward else ""
        label = "hsdp" if self.dp_replicate > 1 else self.strategy
        shape = f"{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"{self.dp}"
        parts = [f"{label}{keep} dp{shape}" if self.dp > 1 else "dp1"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else "")
                         + ("+vocab" if self.tp_vocab_parallel else ""))
        if self.pp > 1:
            v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"pp{self.pp} {self.pp_schedule}{v}")
        return " x ".join(parts)


@dataclass
class Collective:
    """One kind of collective a layout issues per optimizer step (per rank, ring volumes)."""
    kind: str  # all-reduce | reduce-scatter | all-gather | send-recv | tp
    group: str  # dp | tp | pp | tied (first + last pipeline stage)
    what: str
    payload_bytes: int  # K: bytes handed to one call, summed over the calls of one step
    moved_bytes: int  # what one rank sends per step on a ring
    formula: str


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


@dataclass
class Plan:
    world_size: int
    device_memory: int | None
    model: dict
    configured_error: str  # why the configured layout cannot run on world_size ("" if it can)
    layouts: list[LayoutPlan]
    refused: dict[str, str]  # alternative layout -> the one-line reason it was left out

    def to_json(self) -> str:
        def encode(obj):
            d = dataclasses.asdict(obj)
            for lp, rec in zip(obj.layouts, d["layouts"]):
                rec["layout"]["name"] = lp.layout.name
            return d
        return json.dumps(encode(self), indent=1)


# ----------------------------------------------------------------------------- parsing


def parse_bytes(text: str) -> int:
    """'80GB', '80 GiB', '512MB', '80' (GB) -> bytes; UsageError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text or "")
    unit = (m.group(2) or "gb").lower() if m else ""
    if not m or unit not in UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"--device-memory '{text}' is not a memory size; write e.g. 80GB, 80GiB or 512MB")
    return int(float(m.group(1)) * UNITS[unit])


def fmt_bytes(n: float) -> str:
    if n >= 10**9:
        return f"{n / 10**9:.2f} GB"
    if n >= 10**6:
        return f"{n / 10**6:.1f} MB"
    if n >= 10**3:
        return f"{n / 10**3:.1f} kB"
    return f"{n:.0f} B"


# ----------------------------------------------------------------------------- the model


def vocab_size(cfg: Config) -> tuple[int, str]:
    """Vocabulary of this config without training: GPT-2 BPE's 50257, or the characters of the
    corpus when it is on disk (a local file or the cached download; a run folder's tokenizer.json
    wins, as it does for a resume). Falls back to Tiny Shakespeare's 65, said so in the source."""
    if cfg.data.tokenizer == "gpt2":
        return GPT2_VOCAB, "GPT-2 BPE"
    stored = Path(cfg.trainer.run_dir).expanduser() / "tokenizer.json"
    try:
        record = json.loads(stored.read_text(encoding="utf-8"))
        if record.get("kind") == "char":
            return len(record["chars"]), f"characters in {stored}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from corpus.text import corpus_cache_path  # imports torch: only for char vocabularies
    path = Path(cfg.data.path).expanduser()
    if cfg.data.path.startswith(("http://", "https://")):
        path = corpus_cache_path(cfg.data)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return 65, "assumed: Tiny Shakespeare's 65 characters (corpus not on disk)"
    if cfg.data.truncate:
        text = text[:cfg.data.truncate]
    return len(set(text)), f"characters of {path}"


def gpt_config(cfg: Config, vocab: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, **{k: v for k, v in dataclasses.asdict(cfg.model).items()
                                          if k != "init_from"})


def parameter_inventory(g: GPTConfig) -> list[ParamSpec]:
    """model.GPT's parameters in named_parameters() order (a tied head is not listed twice)."""
    c, out = g.n_embd, []

    def add(name, shape, style, where):
        out.append(ParamSpec(name, tuple(shape), style, where))

    add("tok_emb.weight", (g.vocab_size, c), "vocab", "embed")
    add("pos_emb.weight", (g.block_size, c), "replicate", "embed")
    for i in range(g.n_layer):
        p = f"blocks.{i}."

        def linear(name, out_f, in_f, style):
            add(p + name + ".weight", (out_f, in_f), style, "block")
            if g.bias:
                add(p + name + ".bias", (out_f,), "col" if style == "col" else "replicate", "block")

        def norm(name):
            add(p + name + ".weight", (c,), "replicate", "block")
            if g.bias:
                add(p + name + ".bias", (c,), "replicate", "block")

        norm("ln_1")
        for proj in ("q_proj", "k_proj", "v_proj"):
            linear("attn." + proj, c, c, "col")
        linear("attn.out_proj", c, c, "row")
        norm("ln_2")
        linear("mlp.fc", 4 * c, c, "col")
        linear("mlp.proj", c, 4 * c, "row")
    add("ln_f.weight", (c,), "replicate", "head")
    if g.bias:
        add("ln_f.bias", (c,), "replicate", "head")
    if not g.tie_weights:
        add("lm_head.weight", (g.vocab_size, c), "vocab", "head")
    return out


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tp_local_shape(spec: ParamSpec, tp: int, vocab_parallel: bool) -> tuple[int, ...]:
    """The tensor-parallel rank 0 share (DTensor Shard uses torch.chunk: the first ranks get
    ceil(dim / tp))."""
    s = list(spec.shape)
    if tp == 1:
        return tuple(s)
    if spec.tp_style == "col" or (spec.tp_style == "vocab" and vocab_parallel):
        s[0] = ceil_div(s[0], tp)
    elif spec.tp_style == "row":
        s[1] = ceil_div(s[1], tp)
    return tuple(s)


# ----------------------------------------------------------------------------- activations


@dataclass
class ActivationModel:
    """Bytes per element of each kind of saved tensor, for one precision setting."""
    matmul: int  # outputs of Linear layers and attention (autocast: 16-bit)
    residual: int  # the residual stream and LayerNorm inputs (fp32 under autocast)
    casts: bool  # autocast: every Linear saves its own 16-bit copy of its input and weight
    cpu_masks: bool  # dropout masks: CUDA's are bool, CPU's have the dtype of what is dropped
    fused_attention: bool  # SDPA flash/efficient kernel (no s x s matrices saved)


def activation_model(cfg: Config, strategy: str) -> ActivationModel:
    autocast = cfg.trainer.precision != "fp32"
    fsdp_mp = strategy in ("fsdp",) and cfg.parallel.mixed_precision != "none"
    cpu = cfg.trainer.device == "cpu"
    matmul = 2 if (autocast or fsdp_mp) else 4
    residual = 2 if (fsdp_mp and not autocast) else 4
    # Measured (torch 2.13): on CPU, SDPA with dropout falls back to the math kernel and dropout
    # saves its scaled mask in the activation dtype; CUDA's flash/efficient kernels take dropout
    # (saving only an RNG offset) and native_dropout saves a bool mask.
    fused = not (cpu and cfg.model.dropout > 0)
    return ActivationModel(matmul, residual, autocast, cpu, fused)


def block_activation_bytes(g: GPTConfig, am: ActivationModel, b: int, tp: int, sp: bool,
                           checkpointed: bool) -> int:
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
      autocast also keeps a 16-bit copy of every weight (12h^2/tp elements).
    Activation checkpointing keeps only the block input (E/tp with sp)."""
    s, h = g.block_size, g.n_embd
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
    else:  # math kernel: scaled q, k^T, v, softmax, dropout mask, dropped softmax, output copy;
        # autocast runs it in fp32 (measured on CPU), so only the out_proj input is 16-bit
        attn = 4 if am.casts else am.matmul
        total += 3 * e * attn // tp + 3 * b * heads * s * s * attn + e * am.matmul // tp
    total += 8 * e * am.matmul // tp  # GELU input and output (4h each)
    if g.dropout > 0:
        total += 2 * e * (am.matmul if am.cpu_masks else 1) // seq
    if am.casts:
        total += 12 * h * h * am.matmul // tp
    return total


def stage_activation_bytes(g: GPTConfig, am: ActivationModel, b: int, blocks: int, first: bool,
                           last: bool, lay: PlannedLayout) -> int:
    """Saved-for-backward bytes of one pipeline stage (or the whole model) for one micro-batch of
    b sequences: its blocks, plus token/position ids (and the embedding dropout mask) on the
    first stage, plus ln_f, the LM head input and the loss's log-softmax (fp32, b*s*V; over
    tp ranks with vocab-parallel loss) on the last."""
    s, h, v = g.block_size, g.n_embd, g.vocab_size
    tp, sp = lay.tp, lay.sequence_parallel
    seq = tp if sp else 1
    total = blocks * block_activation_bytes(g, am, b, tp, sp, lay.activation_checkpointing)
    if first:
        total += 8 * b * s + 8 * s  # token ids (the embedding's) and positions (int64)
        if g.dropout > 0:
            total += b * s * h * (am.residual if am.cpu_masks else 1) // seq
    if last:
        total += b * s * h * am.residual // seq + 2 * b * s * 4 // seq  # ln_f input, mean/rstd
        total += b * s * h * (am.matmul if am.casts else am.residual)  # LM head input (whole)
        if am.casts:
            total += ceil_div(v, tp if lay.tp_vocab_parallel else 1) * h * am.matmul  # weight copy
        total += 4 * b * s * ceil_div(v, tp if lay.tp_vocab_parallel else 1)  # log-softmax output
        total += 8 * b * s + 4  # targets (int64) and nll_loss's total weight
    return total


# ----------------------------------------------------------------------------- pipelines


def inflight_per_stage(lay: PlannedLayout) -> list[dict[int, int]]:
    """For each pp rank, its local stages' micro-batches whose activations are alive at the
    rank's peak. gpipe: all M; 1f1b: min(M, p - rank) (torch's warm-up, then one backward before
    each forward); interleaved and zero-bubble schedules: torch's own action order replayed."""
    p, m = lay.pp, lay.microbatches
    out = []
    for r in range(p):
        stages = [s for s, rank in enumerate(lay.stage_placement) if rank == r]
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


# ----------------------------------------------------------------------------- one layout


def _owned_tensors(g: GPTConfig, lay: PlannedLayout) -> list[list[tuple[ParamSpec, bool]]]:
    """Per pp rank: (tensor, optimizer owns it) for every tensor held. The tied weight's copy on
    the last stage is a separate tensor when another rank (or, V-shape, another stage module)
    holds the first; a V-shape rank leaves that copy out of the optimizer."""
    inv = parameter_inventory(g)
    if lay.pp == 1:
        return [[(t, True) for t in inv]]
    counts, placement = lay.stage_blocks, lay.stage_placement
    starts = [sum(counts[:i]) for i in range(len(counts))]
    n_stages = len(counts)
    out = []
    for r in range(lay.pp):
        held = []
        stages = [s for s in range(n_stages) if placement[s] == r]
        for s in stages:
            blocks = {str(i) for i in range(starts[s], starts[s] + counts[s])}
            for t in inv:
                if t.where == "block" and t.name.split(".")[1] in blocks:
                    held.append((t, True))
                elif t.where == "embed" and s == 0:
                    held.append((t, True))
                elif t.where == "head" and s == n_stages - 1:
                    held.append((t, True))
            if s == n_stages - 1 and g.tie_weights:
                copy_of = ParamSpec("lm_head.weight", (g.vocab_size, g.n_embd), "vocab", "head")
                held.append((copy_of, 0 not in stages))
        out.append(held)
    return out


def _zero_buckets(tensors: list[ParamSpec], local, cap_bytes: float) -> int:
    """Largest bucket of parallel/zero_shard.py in elements: decay (matrices) then no-decay tensors,
    reversed, a bucket closes once it reaches bucket_cap_mb."""
    order = [t for t in tensors if len(t.shape) >= 2] + [t for t in tensors if len(t.shape) < 2]
    largest, size = 0, 0
    for t in reversed(order):
        size += numel(local(t))
        if size * PARAM_BYTES >= cap_bytes:
            largest, size = max(largest, size), 0
    return max(largest, size)


def plan_layout(cfg: Config, g: GPTConfig, lay: PlannedLayout, configured: bool,
                device_memory: int | None) -> LayoutPlan:
    p = cfg.parallel
    n, tp = lay.dp_shard, lay.tp  # the ranks that shard (HSDP: within a replica group)
    am = activation_model(cfg, lay.strategy)
    per_rank_held = _owned_tensors(g, lay)
    fsdp_like = lay.strategy in ("zero-3", "fsdp") and n > 1
    mp = lay.strategy == "fsdp" and p.mixed_precision != "none"
    gathered_bytes = 2 if mp else PARAM_BYTES  # FSDP2 all-gathers in param_dtype
    reduce_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[p.reduce_dtype] if lay.strategy == "fsdp" else 4

    def local(t: ParamSpec) -> tuple[int, ...]:
        return tp_local_shape(t, tp, lay.tp_vocab_parallel)

    def dp_elems(t: ParamSpec, sharded: bool) -> int:
        shape = local(t)
        if not sharded or n == 1:
            return numel(shape)
        if fsdp_like:  # FSDP2: dim-0 chunks, padded to ceil(dim0 / n) rows on every rank
            return ceil_div(shape[0], n) * numel(shape[1:])
        return ceil_div(numel(shape), n)  # zero-1/2: torch.chunk of the flattened tensor

    shard_params = fsdp_like
    shard_grads = fsdp_like or (lay.strategy == "zero-2" and n > 1)
    shard_optim = fsdp_like or (lay.strategy in ("zero-1", "zero-2") and n > 1)

    stage_counts = lay.stage_blocks
    inflight = inflight_per_stage(lay) if lay.pp > 1 else [{0: 1}]
    b = lay.micro_batch_size
    n_stages = len(stage_counts)
    ranks: list[RankMemory] = []
    collectives_by_rank: list[list[Collective]] = []
    for r, held in enumerate(per_rank_held):
        notes = []
        params = sum(dp_elems(t, shard_params) for t, _ in held) * PARAM_BYTES
        # a V-shape rank's second tied copy (not in the optimizer) drops its gradient once it is
        # added to the first's (parallel/pp.py sync_tied_grads)
        grads = sum(dp_elems(t, shard_grads) for t, owned in held if owned) * PARAM_BYTES
        optim = sum(dp_elems(t, shard_optim) for t, owned in held if owned) * ADAM_STATE_BYTES
        # activations: this rank's stages, each with its micro-batches in flight
        stages = sorted(inflight[r])
        per_mb, act = 0, 0
        for s in stages:
            one = stage_activation_bytes(g, am, b, stage_counts[s], s == 0, s == n_stages - 1, lay)
            per_mb += one
            act += one * inflight[r][s]
        # transients: the logits and their gradient at the loss; a checkpointed block's recompute
        transient = 0
        if n_stages - 1 in stages:
            vloc = ceil_div(g.vocab_size, tp if lay.tp_vocab_parallel else 1)
            transient = b * g.block_size * vloc * (am.matmul + 4)
        if lay.activation_checkpointing:
            full = block_activation_bytes(g, am, b, tp, lay.sequence_parallel, False)
            transient = max(transient, full)
        # communication buffers
        local_elems = sum(numel(local(t)) for t, _ in held)
        block_elems = max((sum(numel(local(t)) for t, _ in held if t.name.startswith(f"blocks.{i}."))
                           for i in range(g.n_layer)), default=0)
        root_elems = sum(numel(local(t)) for t, _ in held if t.where != "block")
        buffers = 0
        host = 0
        if lay.strategy == "ddp" and n > 1 and not p.gradient_as_bucket_view:
            buffers = local_elems * PARAM_BYTES
            notes.append("DDP buckets beside the gradients (gradient_as_bucket_view=false): +4a")
        elif lay.strategy in ("zero-1", "zero-2") and n > 1:
            bucket = _zero_buckets([t for t, _ in held], local, p.bucket_cap_mb * 2**20)
            # stage 2 holds a bucket's full gradients and their packed copy while it reduces;
            # both stages gather a bucket's weights into one buffer (+ this rank's slice)
            copies = 2 if lay.strategy == "zero-2" else 1
            buffers = (copies * bucket + ceil_div(bucket, n)) * PARAM_BYTES
            notes.append("largest ZeRO bucket: " + ("its full gradients + packed copy + slice" if copies == 2
                                                    else "gathered weights + this rank's slice"))
        elif fsdp_like:
            stage_block_elems = sum(numel(local(t)) for t, _ in held if t.where == "block")
            # torch's pipeline stages keep FSDP parameters gathered after every backward but the
            # last (PipelineStage: set_reshard_after_backward(False)), so a stage's blocks can all
            # be gathered at once; without pp two blocks are (the current one and the prefetch)
            whole = not lay.reshard_after_forward or lay.pp > 1
            kept = stage_block_elems if whole else 2 * block_elems
            buffers = (root_elems + kept) * gathered_bytes + 2 * block_elems * reduce_bytes
            if lay.microbatches > 1:
                buffers += local_elems * PARAM_BYTES
                notes.append("FSDP2 keeps unsharded gradients across the accumulated micro-batches")
            notes.append("FSDP2: root (embeddings, head) gathered at the loss and the first backward; "
                         + ("every block of the stage may be gathered at once" if whole
                            else "two blocks gathered at a time"))
        if lay.strategy == "fsdp" and p.cpu_offload and n > 1:
            host = params + grads + optim
            params = grads = optim = 0
            notes.append("cpu_offload: sharded parameters, gradients and Adam state live in host memory")
        peak = params + grads + optim + act + transient + buffers
        ranks.append(RankMemory(r, params, grads, optim, act, per_mb,
                                round(act / per_mb, 2) if per_mb else 0.0, transient, buffers, host, peak, notes))
        collectives_by_rank.append(_collectives(g, lay, held, local, am, stages, n_stages,
                                                gathered_bytes, reduce_bytes))
    top = max(range(len(ranks)), key=lambda i: ranks[i].peak)
    busiest = max(range(len(ranks)), key=lambda i: sum(c.moved_bytes for c in collectives_by_rank[i]))
    by_kind: dict[str, int] = {}
    for c in collectives_by_rank[busiest]:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.moved_bytes
    total = sum(c.moved_bytes for cs in collectives_by_rank for c in cs) * lay.dp * lay.tp
    fits = None if device_memory is None else ranks[top].peak <= device_memory
    return LayoutPlan(lay.name, configured, lay, ranks[top], ranks, collectives_by_rank[busiest],
                      by_kind, total, fits, bubble_fraction(lay))


def _collectives(g: GPTConfig, lay: PlannedLayout, held: list[tuple[ParamSpec, bool]], local,
                 am: ActivationModel, stages: list[int], n_stages: int, gathered_bytes: int,
                 reduce_bytes: int) -> list[Collective]:
    """Ring volumes per optimizer step on the pp rank holding `held` and `stages` (payload K
    bytes, n ranks in the group)."""
    n, tp, m = lay.dp, lay.tp, lay.microbatches
    out: list[Collective] = []
    grad_elems = sum(numel(local(t)) for t, _ in held)
    k = grad_elems * PARAM_BYTES
    if n > 1:
        ring = (n - 1) / n
        if lay.strategy == "ddp":
            out.append(Collective("all-reduce", "dp", "gradients, once per step (no_sync while accumulating)",
                                  k, round(2 * k * ring), "2K(n-1)/n"))
        elif lay.strategy == "zero-1":
            out.append(Collective("reduce-scatter", "dp", "gradients, in the last micro-batch's backward",
                                  k, round(k * ring), "K(n-1)/n"))
            out.append(Collective("all-gather", "dp", "updated parameter slices", k, round(k * ring), "K(n-1)/n"))
        elif lay.strategy == "zero-2":
            out.append(Collective("reduce-scatter", "dp", f"gradients on each of {m} micro-batch(es)",
                                  k * m, round(k * m * ring), "m K(n-1)/n"))
            out.append(Collective("all-gather", "dp", "updated parameter slices", k, round(k * ring), "K(n-1)/n"))
        else:  # FSDP2 (zero-3, fsdp; HSDP: sharded over dp_shard ranks, replicated over dp_replicate)
            ns, reps = lay.dp_shard, lay.dp_replicate
            ring_s = (ns - 1) / ns
            # parallel/fsdp.py passes reshard_after_forward to the root too, which turns off torch's
            # keep-the-root-gathered default (only for reshard_after_forward=None): with resharding,
            # the root (embeddings, ln_f, head) is gathered again in backward like every block
            # (measured: benchmarks/strategy_report.py, 2 x 8 blocks + 2 root all-gathers)
            gathers = 2 if lay.reshard_after_forward else 1
            if ns > 1:
                ag = gathers * grad_elems * gathered_bytes * m
                upper = " (an upper bound under pp: stages stay gathered between backwards)" if lay.pp > 1 else ""
                group = "dp_shard" if reps > 1 else "dp"
                out.append(Collective("all-gather", group, f"parameters, blocks and root: {gathers}x (forward"
                                      f"{' + backward' if gathers == 2 else ''}) per micro-batch{upper}",
                                      ag, round(ag * ring_s), f"m {gathers}K(s-1)/s"))
                rs = grad_elems * reduce_bytes
                out.append(Collective("reduce-scatter", group, "gradients once per step", rs, round(rs * ring_s),
                                      "K(s-1)/s"))
            if reps > 1:  # HSDP: the reduced shards are all-reduced across the replica groups
                ar = ceil_div(grad_elems, ns) * reduce_bytes
                out.append(Collective("all-reduce", "dp_replicate", "gradient shards across the replica groups",
                                      ar, round(2 * ar * (reps - 1) / reps), "2(K/s)(R-1)/R"))
    if tp > 1:
        s, h = g.block_size, g.n_embd
        blocks_here = sum(1 for t, _ in held if t.name.endswith("attn.q_proj.weight"))
        b = lay.micro_batch_size
        act = b * s * h * am.matmul
        first, last = 0 in stages, n_stages - 1 in stages
        vocab = lay.tp_vocab_parallel
        if not lay.sequence_parallel:
            # forward: the row-parallel out_proj and mlp.proj outputs; backward: the input gradient
            # of each column-parallel Linear, q, k, v (three: parallel/tp.py shards them separately)
            # and fc: 6 all-reduces per block where Megatron's fused qkv has 4; vocabulary-parallel:
            # the embedding's output and the LM head's input gradient (measured:
            # benchmarks/strategy_report.py)
            ar, ag_rs = 6 * blocks_here + (vocab and first) + (vocab and last), 0
            what = "all-reduce of (b, s, h): out_proj and proj outputs, q/k/v and fc input gradients"
        else:
            # per block an all-gather before attention and MLP and a reduce-scatter after them,
            # mirrored in backward: 8; the first stage gathers the embedding's gradient
            # (dropout's Replicate -> Shard(1)), the last gathers the head input (vocabulary-
            # parallel: and reduce-scatters its gradient); vocabulary-parallel embedding: 1 all-reduce
            ar = int(vocab and first)
            ag_rs = 8 * blocks_here + first + last + (vocab and last)
            what = "all-gather + reduce-scatter of (b, s, h) around attention and MLP, forward and backward"
        # loss_parallel: the max, the sum of exponentials and the target logit over the vocabulary
        small = 3 * b * s * 4 if vocab and last else 0
        # sequence parallel: LayerNorm gradients come out of backward as Partial DTensors (each
        # rank saw T / tp positions); Strategy.forward_backward all-reduces them once
        # (parallel/dtensor.py settle_partial_grads)
        norms = sum(numel(local(t)) for t, _ in held if t.name.split(".")[-2] in ("ln_1", "ln_2", "ln_f"))
        ln_grads = norms * PARAM_BYTES if lay.sequence_parallel else 0
        payload = ((ar + ag_rs) * act + small) * m + ln_grads
        moved = round((((2 * ar + ag_rs) * act + 2 * small) * m + 2 * ln_grads) * (tp - 1) / tp)
        out.append(Collective("tp", "tp", what, payload, moved,
                              "m bsh e (t-1)/t x (12L, or 8L with sequence parallel, + ends) + LayerNorm grads"))
    if lay.pp > 1:
        e = lay.micro_batch_size * g.block_size * g.n_embd * am.residual // (tp if lay.sequence_parallel else 1)
        # a boundary between two stages of one rank (ZB-V's middle) is a local hand-over, no p2p
        where = lay.stage_placement
        sends = sum((s < n_stages - 1 and where[s + 1] != where[s]) + (s > 0 and where[s - 1] != where[s])
                    for s in stages)
        out.append(Collective("send-recv", "pp", "activations forward and their gradients backward, per micro-batch",
                              sends * e * m, sends * e * m, "m x (b s h e) per stage boundary"))
        if g.tie_weights and (0 in stages) != (n_stages - 1 in stages):
            vloc = ceil_div(g.vocab_size, tp if lay.tp_vocab_parallel else 1)
            kt = vloc * g.n_embd * PARAM_BYTES
            out.append(Collective("all-reduce", "tied", "tied embedding/head gradient, first + last stage",
                                  kt, kt, "2K(2-1)/2"))
    return out


# ----------------------------------------------------------------------------- all layouts


def _layout_config(cfg: Config, strategy: str, tp: int, pp: int) -> Config:
    """cfg with this layout; options of another strategy, tp or pp go back to their defaults."""
    new = copy.deepcopy(cfg)
    p, d = new.parallel, ParallelConfig()
    keep_gathered = strategy == "fsdp-keep"
    replicas = int(strategy.split("-")[1]) if strategy.startswith("hsdp-") else 1
    strategy = "fsdp" if keep_gathered or replicas > 1 else strategy
    name, stage = (strategy.split("-") + ["1"])[:2] if strategy.startswith("zero") else (strategy, "1")
    keep = {"ddp": ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph"),
            "zero": ("bucket_cap_mb",),
            "fsdp": ("reshard_after_forward", "mixed_precision", "reduce_dtype", "cpu_offload", "dp_replicate")}
    if name != cfg.parallel.strategy:
        for k in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "reshard_after_forward",
                  "mixed_precision", "reduce_dtype", "cpu_offload", "dp_replicate"):
            if k not in keep.get(name, ()):
                setattr(p, k, getattr(d, k))
    p.strategy, p.zero_stage = name, int(stage) if name == "zero" else d.zero_stage
    if name == "zero" and p.zero_stage == 3:
        p.bucket_cap_mb = d.bucket_cap_mb
    if name == "zero":
        p.gradient_as_bucket_view, p.static_graph = d.gradient_as_bucket_view, d.static_graph
    if keep_gathered:
        p.reshard_after_forward = False
    if name == "fsdp" and strategy != cfg.parallel.strategy or keep_gathered or replicas > 1:
        p.dp_replicate = replicas
    p.tp, p.pp = tp, pp
    if tp == 1:
        p.tp_vocab_parallel = p.sequence_parallel = False
    if pp == 1:
        for k in ("pp_schedule", "microbatches", "pp_split", "pp_stages_per_rank"):
            setattr(p, k, getattr(d, k))
    elif cfg.parallel.pp != pp:
        p.pp_split = ""  # a split written for another pp does not fit
    return new


def _strategy_label(cfg: Config) -> str:
    p = cfg.parallel
    return f"zero-{p.zero_stage}" if p.strategy == "zero" else p.strategy


def check_layout(cfg: Config, world: int) -> PlannedLayout:
    """The layout of cfg on `world` ranks after the checks a launch runs before any process group
    (config.validate, parallel.layout.Layout.of); UsageError if refused."""
    validate(cfg)
    lay = Layout.of(cfg, world)
    p = cfg.parallel
    # one data-parallel rank: the strategy has nothing to act on (ddp, zero-3 and fsdp leave the
    # model as it is), so those layouts are one layout
    label = _strategy_label(cfg) if lay.dp > 1 else "none"
    return PlannedLayout(label, lay.dp, lay.tp, lay.pp, p.pp_schedule if lay.pp > 1 else "",
                         p.pp_stages_per_rank if lay.pp > 1 else 1, lay.micro_batch_size, lay.microbatches,
                         p.activation_checkpointing, p.sequence_parallel, p.tp_vocab_parallel,
                         p.reshard_after_forward if label == "fsdp" else label == "zero-3",
                         tuple(lay.stage_blocks), tuple(lay.stage_placement),
                         lay.dp_replicate if label == "fsdp" else 1)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(cfg: Config, world: int, device_memory: int | None = None) -> Plan:
    vocab, vocab_source = vocab_size(cfg)
    g = gpt_config(cfg, vocab)
    a = sum(numel(t.shape) for t in parameter_inventory(g))
    model = {"parameters": a, "vocab_size": vocab, "vocab_source": vocab_source,
             **{k: v for k, v in dataclasses.asdict(g).items() if k != "vocab_size"},
             "global_batch": cfg.trainer.batch_size, "precision": cfg.trainer.precision}
    layouts: list[LayoutPlan] = []
    configured_error = ""
    try:
        mine = check_layout(cfg, world)
        layouts.append(plan_layout(cfg, g, mine, True, device_memory))
    except UsageError as e:
        mine, configured_error = None, str(e)
    refused: dict[str, str] = {}
    others: list[LayoutPlan] = []
    seen: list[PlannedLayout] = [mine] if mine is not None else []
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            hsdp = [f"hsdp-{r}" for r in divisors(dp) if 1 < r < dp]  # replica groups x shards
            for strategy in (*DP_STRATEGIES, *hsdp):
                alt = _layout_config(cfg, strategy, tp, pp)
                try:
                    lay = check_layout(alt, world)
                except UsageError as e:
                    refused[f"{strategy} tp{tp} pp{pp}"] = str(e)
                    continue
                if lay in seen:  # e.g. every strategy at dp = 1, or fsdp as configured
                    continue
                seen.append(lay)
                others.append(plan_layout(alt, g, lay, False, device_memory))
    others.sort(key=lambda lp: (lp.fits is False, lp.memory.peak))
    return Plan(world, device_memory, model, configured_error, layouts + others, refused)


# ----------------------------------------------------------------------------- text


LEGEND = """\
per rank, the fullest rank (GB = 10^9 bytes); a = parameters held, n = dp ranks, K = bytes of a collective's payload
  params/grads/Adam: fp32 AdamW, ZeRO (Rajbhandari et al. 2020): ddp 4a+4a+8a = 16a | zero-1 4a+4a+8a/n | zero-2 4a+12a/n | zero-3, fsdp 16a/n
  hsdp RxS (fsdp, parallel.dp_replicate=R): 16a/S per rank; all-gather and reduce-scatter within a group of S, all-reduce of the shards over R
  act: saved for backward x micro-batches in flight (gpipe: M, 1f1b: min(M, p - rank), interleaved/zero-bubble: torch's order);
       per block fp32 16bsh x 4 B + 16bs + 4b(heads)s (Korthikanti et al. 2022's 34sbh + 5as^2b, adapted to SDPA: --explain)
  moved: ring volume per rank per step: all-reduce 2K(n-1)/n, reduce-scatter and all-gather K(n-1)/n; zero-3/fsdp all-gather every
       unit twice (forward, backward; no-reshard once). Measured on CPU/gloo loopback (benchmarks/bytes_per_strategy.py, total over
       ranks / theory 2(N-1)4a for ddp, zero-1/2, fsdp no-reshard, 3(N-1)4a for zero-3/fsdp): N=2 ddp 1.001x, zero-1 1.001x, zero-2 1.002x,
       zero-3 1.003x, fsdp 1.003x, no-reshard 1.004x; N=4 ddp 1.002x, zero-1 1.002x, zero-2 0.985x, zero-3 1.006x, fsdp 1.006x,
       no-reshard 1.006x; each collective against this table: benchmarks/strategy_report.py"""

EXPLAIN = """\
formulas (b = micro-batch sequences, s = block_size, h = n_embd, V = vocabulary, t = tp, E = bsh elements):
  parameters per rank: model.py's shapes; tp splits q/k/v/fc rows and out_proj/proj columns (ceil(dim/t)); zero-1/2 keep
    ceil(numel/n) elements of each tensor; zero-3/fsdp ceil(dim0/n) rows (FSDP2 pads the dim-0 chunks); pp: each stage its
    blocks, the first the embeddings, the last ln_f and a copy of the tied embedding/head (both copies are in the optimizer)
  gradients: as parameters (zero-2 and fsdp: sharded; ddp buckets are the gradients with gradient_as_bucket_view)
  activations per block, saved for backward (measured op by op with saved_tensors_hooks on this model):
    ln_1 and ln_2 inputs 2E (fp32) + mean/rstd 4bs fp32; q/k/v input E and fc input E (autocast: 3 + 1 16-bit copies);
    q, k, v 3E/t; SDPA output E/t (the out_proj input) + logsumexp b(heads/t)s fp32; GELU input and output 8E/t;
    dropout > 0: 2 masks E (bool on CUDA, the activation dtype on CPU, where SDPA also falls back to its math kernel
    and saves 3 b(heads/t)s^2 attention matrices); autocast: a 16-bit copy of every weight (12h^2/t).
    fp32 total 64sbh + 16sb + 4as bytes; Korthikanti et al. 2022 eq. 1 counts 34sbh + 5as^2b in 16-bit without
    fused attention. Sequence parallel splits LayerNorm inputs/stats and masks over t; the gathered q/k/v and fc
    inputs stay whole. Activation checkpointing keeps the block input only (E fp32) and recomputes one block in
    backward (counted as transient). First stage: token and position ids (int64); last stage: ln_f input E, head
    input E, log-softmax output 4bsV (fp32; /t with vocab-parallel loss), targets.
  transient: logits + their fp32 gradient at the loss (bsV (e + 4)), or one recomputed block with checkpointing
  buffers: zero-1/2: the largest bucket (bucket_cap_mb) (zero-2: twice) + its slice; fsdp/zero-3: root parameters
    gathered (at the peak: the loss, the first backward), 2 blocks gathered (a stage's blocks with reshard_after_forward=false or under pp, whose stages keep
    them gathered between backwards) + 2 blocks of unsharded gradients; with gradient accumulation FSDP2 keeps the
    whole unsharded gradient (4a) between micro-batches; ddp: +4a of buckets when gradient_as_bucket_view=false
  moved: tp: 6 all-reduces of E per block per micro-batch (out_proj, proj outputs; q, k, v, fc input gradients, as parallel/tp.py
    shards q/k/v apart), or with sequence parallel 4 all-gathers + 4 reduce-scatters of E (2/3 of those bytes) plus the
    LayerNorm gradients, Partial after backward and all-reduced once; vocabulary-parallel: the
    embedding's all-reduce, the head input's gradient, loss_parallel's 3 bs reductions; pp: activations forward and gradients backward, E per stage
    boundary per micro-batch, plus the tied embedding's gradient all-reduce between the first and last stage
  bubble: (p-1)/(m+p-1) (gpipe, 1f1b), (p-1)/(v m+p-1) interleaved, 0 for zero-bubble (weight passes fill it)"""


def render(pl: Plan, explain: bool = False) -> str:
    m = pl.model
    lines = [f"model: {m['n_layer']} layers x {m['n_embd']} wide, {m['n_head']} heads, block {m['block_size']}, "
             f"vocab {m['vocab_size']} ({m['vocab_source']}), {m['parameters']:,} parameters | "
             f"global batch {m['global_batch']}, {m['precision']} | world {pl.world_size}"
             + (f" | device memory {fmt_bytes(pl.device_memory)}" if pl.device_memory else "")]
    if pl.configured_error:
        lines.append(f"configured layout refused on {pl.world_size} ranks: {pl.configured_error}")
    header = ["", "layout", "mb x M", "params", "grads", "Adam", "act (x in flight)", "buf+tmp", "peak", "fits",
              "all-reduce", "red-scatter", "all-gather", "p2p", "tp", "bubble"]
    rows = []
    for lp in pl.layouts:
        mem, mv = lp.memory, lp.moved_bytes_per_rank
        fits = "-" if lp.fits is None else ("yes" if lp.fits else "NO")
        rows.append(["*" if lp.configured else "", lp.name, f"{lp.layout.micro_batch_size} x {lp.layout.microbatches}",
                     fmt_bytes(mem.params), fmt_bytes(mem.grads), fmt_bytes(mem.optimizer),
                     f"{fmt_bytes(mem.activations)} (x{mem.inflight_microbatches:g})", fmt_bytes(mem.buffers + mem.transient),
                     fmt_bytes(mem.peak), fits,
                     *(fmt_bytes(mv[k]) if mv.get(k) else "-" for k in
                       ("all-reduce", "reduce-scatter", "all-gather", "send-recv", "tp")),
                     f"{lp.bubble:.2f}" if lp.layout.pp > 1 else "-"])
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    if not pl.layouts:  # say why, without the JSON: the distinct reasons
        for reason in sorted(set(pl.refused.values()))[:5]:
            lines.append(f"refused: {reason}")
    lines.append(f"* configured layout; {len(pl.layouts)} layouts shown, {len(pl.refused)} refused "
                 f"(--plan-json lists why); buf+tmp: communication buffers and transients (logits at the loss, a recomputed block); "
                 f"bytes moved per rank per optimizer step, busiest rank")
    lines.append(EXPLAIN if explain else LEGEND)
    return "\n".join(lines)
