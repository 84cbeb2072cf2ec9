"""One layout's prediction: `plan_layout` puts the pieces together for every pipeline rank.

Per pp rank: the parameters it holds (planner/inventory.py), what its data-parallel engine keeps and
moves (planner/engines.py), the activations of its stages times the micro-batches its schedule keeps
in flight (planner/activations.py, planner/schedule.py), and the tensor/pipeline traffic
(planner/traffic.py). The layout's record carries the fullest rank's memory and the busiest rank's
collectives.
"""
from __future__ import annotations

from config import Config
from model import GPTConfig
from parallel.options import Engine
from planner.activations import ActivationModel, activation_model, rank_activation_bytes, transient_bytes
from planner.compute import attention_flops, compute_dtype
from planner.engines import DDPCosts, EngineCosts, ModelState, engine_costs
from planner.hardware import Hardware
from planner.inventory import ADAM_STATE_BYTES, PARAM_BYTES, RankTensors, held_tensors
from planner.records import Collective, LayoutPlan, PlannedLayout, RankMemory
from planner.schedule import bubble_fraction, inflight_per_stage
from planner.timing import step_time
from planner.traffic import cp_collectives, pp_collectives, tp_collective
from planner.units import numel


def plan_layout(cfg: Config, g: GPTConfig, lay: PlannedLayout, configured: bool,
                device_memory: int | None, hardware: Hardware | None = None) -> LayoutPlan:
    """The prediction for `lay` (a `check_layout` result of `cfg`); `fits` is None without
    a device memory (the bytes a layout may use: the device's less the runtime's reserve),
    `time` None without a hardware description."""
    engine = engine_costs(lay, cfg.parallel)
    am = activation_model(cfg, lay.strategy)
    inflight = inflight_per_stage(lay) if lay.pp > 1 else [{0: 1}]
    ranks: list[RankMemory] = []
    traffic: list[list[Collective]] = []
    helds = held_tensors(g, lay)
    for r, held in enumerate(helds):
        ranks.append(rank_memory(g, lay, am, engine, r, held, inflight[r]))
        traffic.append(rank_collectives(g, lay, am, engine, held, sorted(inflight[r])))
    top = max(range(len(ranks)), key=lambda i: ranks[i].peak)
    busiest = max(range(len(ranks)), key=lambda i: sum(c.moved_bytes for c in traffic[i]))
    by_kind: dict[str, int] = {}
    for c in traffic[busiest]:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.moved_bytes
    total = sum(c.moved_bytes for cs in traffic for c in cs) * lay.dp * lay.cp * lay.tp
    fits = None if device_memory is None else ranks[top].peak <= device_memory
    time = None
    if hardware is not None:
        mixed = cfg.parallel.mixed_precision if lay.strategy is Engine.FSDP else "none"
        time = step_time(g, lay, helds, traffic, [r.optimizer // ADAM_STATE_BYTES for r in ranks], hardware,
                         compute_dtype(cfg.trainer.precision, mixed), cfg.trainer.batch_size)
    attention = [attention_flops(g, lay, r) for r in range(lay.cp)] if lay.cp > 1 else []
    return LayoutPlan(lay.name, configured, lay, ranks[top], ranks, traffic[busiest],
                      by_kind, total, fits, bubble_fraction(lay), time, attention_flops_per_cp_rank=attention)


def rank_memory(g: GPTConfig, lay: PlannedLayout, am: ActivationModel, engine: EngineCosts, pp_rank: int,
                held: RankTensors, inflight: dict[int, int]) -> RankMemory:
    """Peak = parameters + gradients + Adam state + activations in flight + transients + buffers."""
    state = engine.model_state(held)
    per_microbatch, activations = rank_activation_bytes(g, am, lay, inflight)
    transient = transient_bytes(g, am, lay, lay.num_stages - 1 in inflight)
    buffers, notes = engine.buffers(held)
    built, built_host = construction_bytes(held, engine, state)
    peak = max(state.params + state.grads + state.optimizer + activations + transient + buffers, built)
    in_flight = round(activations / per_microbatch, 2) if per_microbatch else 0.0
    return RankMemory(pp_rank, state.params, state.grads, state.optimizer, activations, per_microbatch, in_flight,
                      transient, buffers, state.host, peak, notes + list(state.notes), construction=built,
                      construction_host=built_host)


def construction_bytes(held: RankTensors, engine: EngineCosts, state: ModelState,
                       shard_index: int | None = None) -> tuple[int, int]:
    """(device, host) peak bytes on one rank while the model is built and loaded (launch/build.py,
    parallel/materialize.py); the dry run measures both (tools/dry_run.py). The GPT is made on the
    meta device, split and sharded there; then the rank allocates its share of the fp32 parameters
    on its device (`state.params`: sharded by FSDP2/zero-3, whole replicas under ddp and ZeRO-1/2;
    none under cpu_offload), and briefly one more tensor's share on top of it, the largest of:
    - a tied embedding: `to_empty` allocates it once per module that names it, so a module holding
      the embedding and the head tied to it holds the rank's share twice until they are tied again;
    - FSDP2's padding: a rank holding a partial dim-0 chunk (fewer than ceil(dim0 / n) rows) gets
      a padded buffer, filled while the chunk is still alive (FSDPParam.reset_sharded_param);
    - DDP's gradient buckets (4a), allocated after both, when it wraps the replica.
    At `shard_index` (the rank's position among the engine's sharding ranks), or the most any
    position holds. Each parameter is filled from its whole initial value (its generator's, or
    init_from's tensor read from a memory-mapped file), made in host memory one parameter at a time
    and dropped: the host's peak is the largest whole parameter this rank holds a slice of. On a
    CPU the two are one memory: they add."""
    buckets = held.elems * PARAM_BYTES if isinstance(engine, DDPCosts) and engine.ranks > 1 else 0
    names = {t.spec.name for t in held}
    twice = [t for t in held if t.spec.name == "tok_emb.weight"] \
        if state.params and "lm_head.weight" not in names and any(t.spec.where == "head" for t in held) else []
    chunked = bool(state.params) and engine.shards_params and engine.ranks > 1  # FSDP2's dim-0 chunks

    def rows(dim0: int, i: int) -> int:  # rows of a dim-0 chunk at position i (torch.chunk's)
        c = -(-dim0 // engine.ranks)
        return max(0, min(c, dim0 - i * c))

    def local(t, i: int) -> int:  # elements position i allocates for t in to_empty
        return rows(t.shape[0], i) * numel(t.shape[1:]) if chunked else t.elems

    def repadded(t, i: int) -> int:
        return local(t, i) if chunked and 0 < rows(t.shape[0], i) < rows(t.shape[0], 0) else 0

    def on_top(i: int) -> int:
        return max([buckets] + [local(t, i) * PARAM_BYTES for t in twice]
                   + [repadded(t, i) * PARAM_BYTES for t in held])
    # the positions that hold the most: the first, and each tensor's one partial chunk
    partial = {t.shape[0] // rows(t.shape[0], 0) for t in held if chunked and t.shape[0]}
    extra = on_top(shard_index) if shard_index is not None else max(on_top(i) for i in {0} | partial)
    return state.params + extra, max((numel(t.spec.shape) for t in held), default=0) * PARAM_BYTES


def rank_collectives(g: GPTConfig, lay: PlannedLayout, am: ActivationModel, engine: EngineCosts,
                     held: RankTensors, stages: list[int]) -> list[Collective]:
    """Ring volumes per optimizer step on the pp rank holding `held` and `stages`: the data-parallel
    engine's, then tensor parallelism's, then the pipeline's, then context parallelism's."""
    out = engine.collectives(held)
    if lay.tp > 1:
        out.append(tp_collective(g, lay, am, held, stages))
    if lay.pp > 1:
        out += pp_collectives(g, lay, am, stages)
    if lay.cp > 1:
        out += cp_collectives(g, lay, am, held)
    return out
