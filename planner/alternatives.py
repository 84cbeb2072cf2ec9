"""Every layout of a world size: `plan(cfg, world_size, device_memory)` plans the configured
layout first, then each alternative that the launch's own checks accept (checks.validate,
parallel.layout.Layout.of, via `check_layout`), fitting layouts first, fastest first (by peak
without a hardware description); two choices that give the same layout (zero-3 and fsdp with its
defaults) are one row naming both.

An alternative is a `DataParallelChoice` (ddp, zero-1/2/3, fsdp with and without resharding
after forward, HSDP with R replica groups) times every tp x pp that divides the world size.
`layout_config` writes one into a copy of the config, resetting the options that belong to
another strategy, tp or pp by parallel.options' own tables, so the copy passes the same checks a
launch of that layout would.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from checks import validate
from config import Config, ParallelConfig, UsageError
from model import GPTConfig
from parallel.layout import Layout
from parallel.options import PP_ONLY, STRATEGY_ONLY, TP_ONLY, ZERO_STAGE_ONLY, Engine, per_block_settings
from planner.hardware import Hardware
from planner.inventory import gpt_config, parameter_inventory, vocab_size
from planner.layout_plan import plan_layout
from planner.records import LayoutPlan, Plan, PlannedLayout
from planner.units import numel


@dataclass(frozen=True)
class DataParallelChoice:
    """What an alternative puts on the data-parallel dimension."""
    engine: Engine
    reshard_after_forward: bool = True  # fsdp: False keeps the parameters gathered from forward to backward
    replicas: int = 1  # fsdp: HSDP's replica groups (parallel.dp_replicate)

    @property
    def label(self) -> str:
        """The name in `Plan.refused`: 'zero-2', 'fsdp-keep', 'hsdp-2'."""
        if self.replicas > 1:
            return f"hsdp-{self.replicas}"
        return self.engine.value if self.reshard_after_forward else f"{self.engine.value}-keep"

    @property
    def is_plain_fsdp(self) -> bool:
        return self.engine is Engine.FSDP and self.reshard_after_forward and self.replicas == 1


DP_CHOICES = tuple(DataParallelChoice(e) for e in (Engine.DDP, Engine.ZERO1, Engine.ZERO2, Engine.ZERO3, Engine.FSDP)) \
    + (DataParallelChoice(Engine.FSDP, reshard_after_forward=False),)


def hsdp_choices(dp: int) -> list[DataParallelChoice]:
    """R replica groups x dp/R shards for every R that is neither plain fsdp (1) nor ddp-like (dp)."""
    return [DataParallelChoice(Engine.FSDP, replicas=r) for r in divisors(dp) if 1 < r < dp]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(cfg: Config, world: int) -> PlannedLayout:
    """The layout of cfg on `world` ranks after the checks a launch runs before any process group
    (checks.validate, parallel.layout.Layout.of); UsageError if refused."""
    validate(cfg)
    lay = Layout.of(cfg, world)
    p = cfg.parallel
    # one data-parallel rank: the strategy has nothing to act on (ddp, zero-3 and fsdp leave the
    # model as it is), so those layouts are one layout; under cp the engine runs over dp x cp
    engine = Engine.of(p) if lay.dp * lay.cp > 1 else Engine.NONE
    fsdp = engine is Engine.FSDP
    return PlannedLayout(lay, engine, p.pp_schedule if lay.pp > 1 else "", p.activation_checkpointing,
                         p.sequence_parallel, p.tp_vocab_parallel,
                         p.reshard_after_forward if fsdp else engine is Engine.ZERO3, p.cp_mode if lay.cp > 1 else "")


def layout_config(cfg: Config, choice: DataParallelChoice, tp: int, pp: int) -> Config:
    """cfg with this layout; options of another strategy, tp or pp go back to their defaults."""
    new = copy.deepcopy(cfg)
    _apply_choice(new.parallel, choice, cfg.parallel.strategy)
    _apply_model_split(new.parallel, tp, pp, cfg.parallel.pp)
    if per_block_settings(new.parallel):
        new.trainer.compile_scope = "blocks"  # one graph of the whole model is one process's, no engine's
    return new


def _apply_choice(p: ParallelConfig, choice: DataParallelChoice, configured: str) -> None:
    d, values = ParallelConfig(), choice.engine.config_values
    strategy = values["strategy"]
    if configured == "auto":  # auto's own keys (tp, pp...) are the alternatives' to set
        p.auto_world_size = d.auto_world_size
    if strategy != configured:
        for key, owners in STRATEGY_ONLY.items():
            if strategy not in owners:
                setattr(p, key, getattr(d, key))
    p.strategy, p.zero_stage = strategy, values.get("zero_stage", d.zero_stage)
    if strategy == "zero":
        for key, stages in ZERO_STAGE_ONLY.items():
            if p.zero_stage not in stages:
                setattr(p, key, getattr(d, key))
        p.gradient_as_bucket_view, p.static_graph = d.gradient_as_bucket_view, d.static_graph
    if not choice.reshard_after_forward:
        p.reshard_after_forward = False
    # plain fsdp on a config that is fsdp already keeps its replica groups; every other fsdp
    # choice sets them
    if choice.engine is Engine.FSDP and (configured != "fsdp" or not choice.is_plain_fsdp):
        p.dp_replicate = choice.replicas


def _apply_model_split(p: ParallelConfig, tp: int, pp: int, configured_pp: int) -> None:
    d = ParallelConfig()
    p.tp, p.pp = tp, pp
    if tp == 1:
        for key in TP_ONLY:
            setattr(p, key, getattr(d, key))
    if pp == 1:
        for key in PP_ONLY:
            setattr(p, key, getattr(d, key))
    elif configured_pp != pp:
        p.pp_split = ""  # a split written for another pp does not fit


def model_summary(cfg: Config, g: GPTConfig, vocab_source: str) -> dict:
    a = sum(numel(t.shape) for t in parameter_inventory(g))
    return {"parameters": a, "vocab_size": g.vocab_size, "vocab_source": vocab_source,
            **{k: v for k, v in dataclasses.asdict(g).items() if k != "vocab_size"},
            "global_batch": cfg.trainer.batch_size, "precision": cfg.trainer.precision}


def refuse_unplanned_optimizer(cfg: Config) -> None:
    """The planner counts AdamW's state (8 bytes per parameter); Muon keeps 4 for the blocks'
    matrices: a plan of it would be silently wrong, so it is refused instead."""
    if cfg.optimizer.name != "adamw":
        raise UsageError(f"the planner models AdamW's state; optimizer.name={cfg.optimizer.name} keeps less for the "
                         f"blocks' matrices: plan with optimizer.name=adamw (an upper bound on memory)")


def plan(cfg: Config, world: int, device_memory: int | None = None, hardware: Hardware | None = None,
         reserve: int = 0) -> Plan:
    """The configured layout (or why `world` ranks cannot run it), then every alternative; a
    layout fits when its peak is at most device_memory - reserve."""
    refuse_unplanned_optimizer(cfg)
    vocab, vocab_source = vocab_size(cfg)
    g = gpt_config(cfg, vocab)
    usable = None if device_memory is None else device_memory - reserve
    layouts: list[LayoutPlan] = []
    seen: list[PlannedLayout] = []
    configured_error = ""
    if cfg.parallel.strategy == "auto":
        configured_error = "parallel.strategy=auto: the launch runs the first row that fits"
    else:
        try:
            mine = check_layout(cfg, world)
            layouts.append(plan_layout(cfg, g, mine, True, usable, hardware))
            seen.append(mine)
        except UsageError as e:
            configured_error = str(e)
    others, refused = _alternatives(cfg, g, world, usable, seen, hardware)
    others = merge_aliases(layouts + others)[len(layouts):]
    others.sort(key=rank_key)
    return Plan(world, device_memory, model_summary(cfg, g, vocab_source), configured_error, layouts + others, refused,
                reserve, f"{hardware.name}: {hardware.source}" if hardware else "")


def rank_key(lp: LayoutPlan) -> tuple:
    """Fitting layouts first; then the fastest (with a hardware description), then the smallest peak."""
    return (lp.fits is False, lp.time.step_s if lp.time else 0.0, lp.memory.peak)


def merge_aliases(plans: list[LayoutPlan]) -> list[LayoutPlan]:
    """One row per distinct layout: a plan equal to an earlier one but for the engine's name
    (zero-3 is FSDP2 with fsdp's defaults) becomes an alias of the earlier row."""
    kept: list[LayoutPlan] = []
    for lp in plans:
        same = next((k for k in kept if k.layout.strategy is not lp.layout.strategy
                     and dataclasses.replace(k.layout, strategy=lp.layout.strategy) == lp.layout
                     and k.memory == lp.memory and k.collectives == lp.collectives), None)
        if same is None:
            kept.append(lp)
        else:
            same.aliases.append(lp.layout.strategy.value)
    return kept


def _alternatives(cfg: Config, g: GPTConfig, world: int, device_memory: int | None,
                  seen: list[PlannedLayout], hardware: Hardware | None) -> tuple[list[LayoutPlan], dict[str, str]]:
    """Every layout not in `seen` that the launch checks accept, and why each other one is refused."""
    others: list[LayoutPlan] = []
    refused: dict[str, str] = {}
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            for choice in (*DP_CHOICES, *hsdp_choices(dp)):
                best, why, tried, accepted = None, "", [], False
                for alt in head_choices(layout_config(cfg, choice, tp, pp)):
                    try:
                        lay = check_layout(alt, world)
                    except UsageError as e:
                        why = why or str(e)
                        continue
                    accepted = True
                    if lay in seen:  # e.g. every strategy at dp = 1, or fsdp as configured
                        continue
                    tried.append(lay)
                    candidate = plan_layout(alt, g, lay, False, device_memory, hardware)
                    if best is None or rank_key(candidate) < rank_key(best):
                        best = candidate
                seen += tried  # the head not kept is not offered again by another strategy's name
                if best is not None:
                    others.append(best)
                elif why and not accepted:  # refused only if no head of this choice is a layout
                    refused[f"{choice.label} tp{tp} pp{pp}"] = why
    return others, refused


def head_choices(cfg: Config) -> list[Config]:
    """cfg, and under tp with a replicated LM head also with the vocabulary-parallel one: the
    planner keeps the better (a replicated head computes whole on every tp rank while each block is
    split tp ways: GPT-2 XL's 50,257 x 1600 head is 2.4 blocks' FLOPs, at tp 8 as much as 19
    blocks' shares)."""
    if cfg.parallel.tp == 1 or cfg.parallel.tp_vocab_parallel:
        return [cfg]
    vocab = copy.deepcopy(cfg)
    vocab.parallel.tp_vocab_parallel = True
    return [cfg, vocab]


def cp_degrees(cfg: Config, world: int) -> list[int]:
    """The parallel.cp values the planner tries when nothing fits (auto's search, --plan's
    advice): 2, 4, 8 where the world size and the block (2 cp chunks) split and dropout is 0."""
    m = cfg.model
    return [c for c in (2, 4, 8) if world % c == 0 and m.block_size % (2 * c) == 0 and m.dropout == 0]


def refuse_unpriced(cfg: Config, flag: str) -> None:
    """UsageError where the planner and the dry run cannot price the config: they price one precision
    (auto is only chosen at launch, on the device) and the fused attention kernel (matmul attention's
    T x T probabilities are not modelled). Called by what compares a plan with a run or a dry run
    (main.py's --plan and --dry-run, benchmarks/strategy_report.py), before anything runs."""
    if cfg.trainer.precision == "auto":
        raise UsageError(f"{flag} prices one precision and trainer.precision=auto is chosen at launch from the "
                         f"device; set trainer.precision=bf16 or fp32 (what the launch's start-up line names)")
    if cfg.trainer.attention != "sdpa":
        raise UsageError(f"{flag} prices torch's fused attention and trainer.attention={cfg.trainer.attention} holds "
                         f"every head's T x T probabilities, which it does not model; set trainer.attention=sdpa")
