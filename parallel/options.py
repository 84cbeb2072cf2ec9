"""What `parallel.*` means before a world size is known: the data-parallel engine a config
selects, and every rule on the parallel keys that needs only the config.

`Engine` is the one name of a data-parallel strategy: config's `parallel.strategy` +
`parallel.zero_stage` map onto it (`Engine.of`), the strategy registry (parallel/registry.py) is
keyed by it, and the planner enumerates it. The rules (options that belong to another strategy,
a pipeline split that adds up, heads and sequence divisible by tp) are yielded as one-line
problems; checks.validate raises them as one UsageError. Checks that need the world size
live in parallel/layout.py (`Layout.of`).

It imports only config.py (its choices: STRATEGY_NAMES, PP_SCHEDULES), never torch.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Iterator

from config import Config, ModelConfig, ParallelConfig, TrainerConfig

AUTO_CHOOSES = ("tp", "pp", "pp_schedule", "microbatches", "pp_stages_per_rank", "activation_checkpointing",
                "tp_vocab_parallel")
# Memory sizes as people write them: a unit without "i" is decimal (SI: GB = G = 10^9 bytes, as
# Kubernetes reads "G" and disk makers print "GB"), one with "i" binary (GiB = Gi = 2^30); case
# does not matter; a bare number is GB. 40G = 40GB = 40 GB = 40e9 bytes, 40GiB = 42.9e9 bytes.
MEMORY_UNITS = {"": 10**9, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def memory_size(text: str) -> int | None:
    """'40G', '40GB', '40 GB', '40GiB', '512MB', '80' (GB) -> bytes; None if it is not a size."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGTkmgt]?[iI]?)([bB]?)\s*", str(text or ""))
    if not m:
        return None
    unit = m.group(2).lower() if m.group(2) else ("b" if m.group(3) else "")
    if unit not in MEMORY_UNITS or float(m.group(1)) <= 0:
        return None
    return int(float(m.group(1)) * MEMORY_UNITS[unit])


class Engine(str, Enum):
    """The engine on the data-parallel dimension (the ZeRO paper's stages, Rajbhandari et al. 2020)."""
    NONE = "none"  # one replica, no data parallelism
    DP = "dp"  # nn.DataParallel: one process, all GPUs
    DDP = "ddp"  # replicated, gradients all-reduced
    ZERO1 = "zero-1"  # + optimizer state sharded
    ZERO2 = "zero-2"  # + gradients sharded
    ZERO3 = "zero-3"  # + weights sharded (FSDP2 underneath)
    FSDP = "fsdp"  # FSDP2 fully_shard with its own knobs (reshard, mixed precision, HSDP, offload)

    @classmethod
    def of(cls, p: ParallelConfig) -> "Engine":
        return cls(f"zero-{p.zero_stage}" if p.strategy == "zero" else p.strategy)

    @property
    def config_values(self) -> dict[str, object]:
        """The parallel.* values that select this engine."""
        if self.value.startswith("zero-"):
            return {"strategy": "zero", "zero_stage": int(self.value[-1])}
        return {"strategy": self.value}

    @property
    def overrides(self) -> list[str]:
        """The same as command-line overrides, e.g. ['parallel.strategy=zero', 'parallel.zero_stage=2']."""
        return [f"parallel.{k}={v}" for k, v in self.config_values.items()]


def world_size_problem(world_size: int, tp: int, pp: int, cp: int = 1) -> str | None:
    """The most basic blocker of a launch: tp x pp (x cp) ranks must tile the world."""
    if world_size % (tp * pp * cp):
        names = "parallel.tp * parallel.pp" + (" * parallel.cp" if cp > 1 else "")
        return (f"world size {world_size} is not divisible by {names} = {tp * pp * cp}; "
                f"launch a multiple of {tp * pp * cp} processes")
    return None


def problems(cfg: Config, world_size: int | None = None) -> Iterator[str]:
    """Every config-only problem of the parallel keys, one line each, in the order a user should
    fix them; with `world_size` (the launch's), whether tp x pp tiles it comes first."""
    p, m = cfg.parallel, cfg.model
    if world_size is not None and (blocker := world_size_problem(world_size, p.tp, p.pp, p.cp)):
        yield blocker
    if m.n_head % p.tp:
        yield (f"model.n_head={m.n_head} is not divisible by parallel.tp={p.tp}; "
               f"attention heads are split across tensor-parallel ranks")
    yield from _option_problems(p)
    yield from _auto_problems(p)
    yield from _optimizer_problems(cfg.optimizer.name, p)
    if p.strategy == "auto" and cfg.trainer.attention != "sdpa":
        yield (f"trainer.attention={cfg.trainer.attention}: parallel.strategy=auto plans the fused attention's "
               f"memory, not every head's T x T probabilities; set trainer.attention=sdpa or name a strategy")
    yield from _model_split_problems(m, cfg.trainer, p)
    yield from _context_parallel_problems(cfg)
    yield from _compile_scope_problems(cfg)


def per_block_settings(p: ParallelConfig) -> str:
    """The parallel settings that work on single blocks, so that a whole-model graph
    (trainer.compile_scope=model) cannot hold them: an engine, tp/pp/cp, recomputation ("" = none)."""
    return ", ".join([f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "cp") if getattr(p, k) > 1]
                     + ([f"parallel.strategy={p.strategy}"] if p.strategy != "none" else [])
                     + (["parallel.activation_checkpointing=true"] if p.activation_checkpointing else []))


def _compile_scope_problems(cfg: Config) -> Iterator[str]:
    """trainer.compile_scope=model: one graph over the blocks and the head, for one process with no
    engine: the engines' hooks (DDP's buckets, FSDP2's gathers), the pipeline and tensor/context
    splits and per-block recomputation all work on single blocks (parallel/parallelize.py step 4)."""
    t = cfg.trainer
    if t.compile_scope != "model":
        return
    if not t.compile:
        yield "trainer.compile_scope=model compiles nothing without trainer.compile=true; set trainer.compile=true"
    if what := per_block_settings(cfg.parallel):
        yield (f"trainer.compile_scope=model compiles one process's whole model as one graph, and {what} works on "
               f"single blocks; use trainer.compile_scope=blocks (each block compiled) or parallel.strategy=none alone")


def _auto_problems(p: ParallelConfig) -> Iterator[str]:
    defaults = type(p)()
    if p.device_memory and memory_size(p.device_memory) is None:
        yield (f"parallel.device_memory='{p.device_memory}' is not a memory size; write e.g. 40GB or 40G "
               f"(10^9 bytes), 40GiB (2^30), or '' for no limit")
    if p.auto_world_size < 0:
        yield f"parallel.auto_world_size must be >= 0, got {p.auto_world_size}"
    if p.strategy != "auto":
        return
    for key in AUTO_CHOOSES:
        if getattr(p, key) != getattr(defaults, key):
            yield (f"parallel.{key} is chosen by parallel.strategy=auto; remove it, or name a strategy "
                   f"(python main.py --plan shows the candidates)")


def _optimizer_problems(name: str, p: ParallelConfig) -> Iterator[str]:
    """Muon orthogonalises whole matrices (parallel/muon.py): DTensor shards (FSDP2, tp) are
    gathered for it; ZeRO-1/2's flat slices of plain tensors are not, and auto's planner does
    not model Muon's state."""
    if name != "muon":
        return
    if p.strategy == "zero" and p.zero_stage in (1, 2):
        yield (f"optimizer.name=muon orthogonalises whole matrices and ZeRO-{p.zero_stage} keeps flat slices of "
               f"them; use parallel.zero_stage=3 or parallel.strategy=fsdp (gathered per matrix), ddp, or "
               f"optimizer.name=adamw")
    if p.strategy == "auto":
        yield ("optimizer.name=muon: parallel.strategy=auto plans AdamW's state only; name a strategy "
               "(ddp, fsdp, tp and pp all run Muon) or use optimizer.name=adamw")


# Options that only mean something for some strategies: setting them elsewhere is a mistake the
# user should hear about, not a silent no-op. These tables are public so that code moving a config
# to another strategy, tp or pp (the planner's alternatives) resets options by the same rules.
STRATEGY_ONLY = {
    "zero_stage": ("zero",),
    "reshard_after_forward": ("fsdp",),
    "mixed_precision": ("fsdp",),
    "reduce_dtype": ("fsdp",),
    "cpu_offload": ("fsdp",),
    "dp_replicate": ("fsdp",),
    "bucket_cap_mb": ("ddp", "zero"),
    "gradient_as_bucket_view": ("ddp",),
    "static_graph": ("ddp",),
}
# Within zero, buckets mean something only where ZeRO-1/2's own engine is used (stage 3 is
# FSDP2, which gathers and reduces per fully_shard group).
ZERO_STAGE_ONLY = {"bucket_cap_mb": (1, 2)}
PP_ONLY = ("pp_schedule", "microbatches", "pp_split", "pp_stages_per_rank")  # defaults unless parallel.pp > 1
TP_ONLY = ("tp_vocab_parallel", "sequence_parallel")  # false unless parallel.tp > 1
CP_ONLY = ("cp_mode",)  # defaults unless parallel.cp > 1
# The engines context parallelism composes with so far (each proven equal to one process by a parity
# test; the combinations with tp, pp, recomputation, autocast and compile that have a case of their
# own are listed in docs/layouts.md, the rest in docs/correctness.md).
CP_STRATEGIES = ("none", "ddp", "fsdp")


def _context_parallel_problems(cfg: Config) -> Iterator[str]:
    """parallel.cp > 1: the sequence split (parallel/cp.py) and what it does not compose with yet."""
    p, m = cfg.parallel, cfg.model
    if p.cp == 1:
        return
    if m.block_size % (2 * p.cp):
        yield (f"model.block_size={m.block_size} is not divisible by 2 x parallel.cp = {2 * p.cp}; each "
               f"sequence is cut into 2 cp chunks (rank i holds chunks i and 2cp-1-i): use a multiple of {2 * p.cp}")
    if m.dropout > 0:
        yield (f"model.dropout={m.dropout}: parallel.cp needs model.dropout=0 (the CPU flash kernel refuses "
               f"attention dropout, and per-rank masks could never match one process's); set model.dropout=0")
    if cfg.trainer.attention != "sdpa":
        yield (f"trainer.attention={cfg.trainer.attention}: parallel.cp computes attention in its own ring or "
               f"all-gather kernels (parallel/cp.py); set trainer.attention=sdpa")
    if p.strategy == "dp":
        yield ("parallel.cp splits each sequence over processes and parallel.strategy=dp (nn.DataParallel) "
               "runs one process; use parallel.strategy=ddp or none under torchrun")
    elif p.strategy not in CP_STRATEGIES:
        yield (f"parallel.cp > 1 runs with parallel.strategy={' or '.join(CP_STRATEGIES)} so far, not "
               f"'{p.strategy}'{' (auto chooses parallel.cp itself when nothing fits: leave cp at 1)' if p.strategy == 'auto' else ''}"
               f": no test holds the two together to one process's training yet; change the strategy")
    for key, value, fix in (("mixed_precision", p.mixed_precision != "none", "parallel.mixed_precision=none"),
                            ("dp_replicate", p.dp_replicate > 1, "parallel.dp_replicate=1"),
                            ("cpu_offload", p.cpu_offload, "parallel.cpu_offload=false")):
        if value:
            yield (f"parallel.cp > 1 does not compose with parallel.{key} yet: no test holds the two together "
                   f"to one process's training; set {fix}")


def _model_split_problems(m: ModelConfig, t: TrainerConfig, p: ParallelConfig) -> Iterator[str]:
    """Tensor/pipeline-parallel checks that need only the config (the batch split needs the world
    size: Layout.of)."""
    local = m.block_size // p.cp if m.block_size % (2 * p.cp) == 0 else m.block_size  # cp: this rank's tokens
    if p.sequence_parallel and local % p.tp:
        held = f"model.block_size={m.block_size}" if p.cp == 1 else f"each cp rank's {local} tokens (block / cp)"
        yield (f"{held} is not divisible by parallel.tp={p.tp}; "
               f"sequence parallelism splits the sequence across tensor-parallel ranks")
    if p.pp == 1:
        return
    stages = p.pp * p.pp_stages_per_rank
    if p.pp_split:
        parts = p.pp_split.split(",")
        if not all(s.strip().isdigit() and int(s) >= 1 for s in parts):
            yield (f"parallel.pp_split='{p.pp_split}' must be comma-separated block counts "
                   f">= 1, e.g. '3,1'")
            return  # the checks below read the counts
        if len(parts) != stages:
            yield (f"parallel.pp_split='{p.pp_split}' has {len(parts)} stages but pp x "
                   f"pp_stages_per_rank = {stages}; give {stages} counts")
        if sum(int(s) for s in parts) != m.n_layer:
            yield (f"parallel.pp_split='{p.pp_split}' sums to {sum(int(s) for s in parts)} "
                   f"blocks but model.n_layer={m.n_layer}; make the counts add up to n_layer")
    elif m.n_layer < stages:
        yield (f"model.n_layer={m.n_layer} is fewer than the {stages} pipeline stages (pp x "
               f"pp_stages_per_rank); every stage needs a block: lower parallel.pp")
    elif m.n_layer % stages:
        yield (f"model.n_layer={m.n_layer} does not split evenly into {stages} pipeline stages "
               f"(pp x pp_stages_per_rank); set parallel.pp_split, e.g. "
               f"'{','.join(str(len(c)) for c in _even_chunks(m.n_layer, stages))}'")
    if p.pp_schedule in ("gpipe", "1f1b") and p.pp_stages_per_rank != 1:
        yield (f"parallel.pp_schedule={p.pp_schedule} runs one stage per rank; set "
               f"parallel.pp_stages_per_rank=1 or use interleaved_1f1b")
    if p.pp_schedule == "interleaved_1f1b" and p.pp_stages_per_rank < 2:
        yield ("parallel.pp_schedule=interleaved_1f1b needs parallel.pp_stages_per_rank >= 2; "
               "set it to 2, or use 1f1b")
    if p.pp_schedule == "zero_bubble" and t.compile:
        yield ("parallel.pp_schedule=zero_bubble splits backward into input and weight passes, "
               "which torch.compile does not support; set trainer.compile=false or use 1f1b")
    if p.pp_schedule == "zero_bubble" and p.activation_checkpointing:
        # torch.distributed.pipelining's weight pass (stage_backward_weight) runs one autograd.grad
        # per parameter group, and non-reentrant checkpointing recomputes the block inside each
        # call: a tp=2 x pp=2 dry run measured the forward's tp collectives 9 times, not once.
        yield ("parallel.pp_schedule=zero_bubble with parallel.activation_checkpointing recomputes "
               "each block once per weight group in the weight pass (many forwards, not one); "
               "use 1f1b or interleaved_1f1b with recomputation, or turn it off")
    if p.microbatches and p.pp_schedule != "gpipe" and p.microbatches < p.pp:
        yield (f"parallel.microbatches={p.microbatches} is below parallel.pp={p.pp}; "
               f"{p.pp_schedule} needs at least one micro-batch per stage (or use gpipe)")


def _even_chunks(n: int, k: int) -> list[range]:
    return [range(i * n // k, (i + 1) * n // k) for i in range(k)]


def _option_problems(p: ParallelConfig) -> Iterator[str]:
    defaults = type(p)()  # the dataclass defaults, without importing config at run time
    for key, owners in STRATEGY_ONLY.items():
        if getattr(p, key) != getattr(defaults, key) and p.strategy not in owners:
            yield (f"parallel.{key} only applies to parallel.strategy="
                   f"{' or '.join(owners)}, not '{p.strategy}'; remove it or change strategy")
    if p.strategy == "zero":
        for key, stages in ZERO_STAGE_ONLY.items():
            if getattr(p, key) != getattr(defaults, key) and p.zero_stage not in stages:
                yield (f"parallel.{key} only applies to parallel.zero_stage="
                       f"{' or '.join(map(str, stages))}, not {p.zero_stage}; remove it")
    # under auto, the keys it chooses are refused by _auto_problems (setting pp or tp is no fix there)
    chosen = AUTO_CHOOSES if p.strategy == "auto" else ()
    if p.pp == 1:
        for key in PP_ONLY:
            if getattr(p, key) != getattr(defaults, key) and key not in chosen:
                yield (f"parallel.{key} only applies with parallel.pp > 1; set parallel.pp")
    if p.tp == 1:
        for key in TP_ONLY:
            if getattr(p, key) and key not in chosen:
                yield (f"parallel.{key} only applies with parallel.tp > 1; set parallel.tp")
    if p.cp == 1:
        for key in CP_ONLY:
            if getattr(p, key) != getattr(defaults, key):
                yield f"parallel.{key} only applies with parallel.cp > 1; set parallel.cp"
