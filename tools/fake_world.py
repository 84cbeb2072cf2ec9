"""One simulated rank of a launch of any world size, in this process: torch's fake process group
(every collective returns at once, moving nothing) and FakeTensorMode (tensors with shapes,
dtypes and storages, but no data), with the real Layout, DeviceMesh, model construction (meta,
then this rank's share: launch/build.py place_model, its allocations measured), parallelize,
strategy and Trainer (`build_rank`), measured through one whole optimizer step (`measure_rank`).

The seams, each the smallest that lets the real code run on fake tensors (docs/planner.md lists
what they leave uncovered):
- the DeviceMesh computes its coordinates from a real tensor of ranks: it is built outside
  FakeTensorMode (FSDP2 builds meshes too, under tp, so DeviceMesh.__init__ leaves the mode for
  as long as it runs: `fake_world`);
- the model's meta phase runs on real meta tensors, as in a launch, and the fake mode is on again
  from materialize on (`_place_model`);
- what no launch allocates is left out of the construction's bytes (AllocationPeak.apart): the
  tensors DTensor's sharding propagation makes on the fake mode (its own fake mode in a launch)
  and the static pipeline-stage examples;
- object collectives (the tracker's peak label, a pipeline's merged dicts, DCP's gathers) pickle
  into tensors the fake group never fills: inside `fake_world` every rank gets its own object back
  (what every rank of a real launch computes from the same config);
- DDP's start-up check compares parameters across ranks: skipped on the fake group
  (`_UncheckedDDP` in parallel/ddp.py's place, init_sync off); its reducer asserts on the fake
  group's empty results, so each bucket is all-reduced by a comm hook (the same call, payload and
  group);
- pipeline stages get static shapes on the fake group (`_StaticStage` made by Pipeline.make_stage,
  `static_stage_args`);
- context parallelism needs none: the fake group runs point-to-point ops (`batch_isend_irecv` of
  the ring, each send and receive seen at the dispatcher as c10d.send / c10d.recv_) and
  allgather's collectives, and what a rank receives is a fake tensor like every other;
- log-step reads (`.item()` of the loss and norm) are not run: only Trainer.train_step;
- the snapshot's DCP save plan is created (DefaultSavePlanner.create_local_plan), not written.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from char_dataset import Batching
from config import Config
from launch.build import assemble, place_model
from model import GPTConfig, ModelCost
from parallel import ddp, parallelize
from parallel.env import DTYPES, DistEnv
from parallel.layout import Layout
from parallel.pp import Pipeline, Stage
from parallel.registry import build_strategy
from parallel.strategy import Strategy
from snapshots.format import split_state
from snapshots.store import SnapshotManager
from tools.measure import AllocationPeak, Call, CollectiveCounter, SavedBytes, cp_phase, norm_phase
from trainer import Trainer


class FakeData:
    """The Trainer's dataset: every batch is (B/dp, T) token ids of zeros (their values never
    matter on fake tensors)."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def check_batch(self, global_batch: int) -> None:
        pass

    def steps_per_epoch(self, global_batch: int) -> float:
        return 1.0

    def train_batch(self, step: int, b: Batching) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(b.global_batch // b.dp_size, self.block_size, dtype=torch.long)
        return x, x


def _own_object_back(*objects):
    """An object collective on the fake group: every rank receives its own objects."""
    def gather(out, obj, *args, **kwargs):
        if out is not None:
            out[:] = [obj] * len(out)

    def gather_to(obj, out=None, *args, **kwargs):
        if out is not None:
            out[:] = [obj] * len(out)
    return {"broadcast_object_list": lambda objs, *a, **k: None, "all_gather_object": gather,
            "gather_object": gather_to}


class _StaticStage(Stage):
    """A pipeline stage on the fake group, where nothing arrives: the shape inference's object
    messages cannot run, so every stage gets static shapes (`static_stage_args`), and the warm-up
    vote, whose answer is then known (every stage is static), is not exchanged (a received
    tensor would be fake, and its `.item()` raises)."""

    def _warmup_forward_vote(self, has_backward: bool, received_acc: torch.Tensor | None = None) -> torch.Tensor:
        return torch.tensor([1], dtype=torch.int32)  # FakeTensorMode keeps a literal's value: .item() works

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        return self._warmup_forward_vote(True)


def static_stage_args(cfg: Config, layout: Layout, stage: int, device: torch.device) -> dict:
    """PipelineStage's input_args/output_args of `stage`, from the layout alone: token ids (b, T)
    into the first stage; between stages the residual stream (b, T, C), (b, T / tp, C) under
    sequence parallelism (parallel/tp.py keeps it a local tensor), in FSDP2's parameter dtype
    when its mixed precision runs, else fp32 (autocast computes the residual stream in fp32); out
    of the last stage the logits (only their existence matters: no stage receives them). Under
    cp every T is this rank's T / cp tokens of each sequence."""
    p, m = cfg.parallel, cfg.model
    b, t = layout.micro_batch_size, m.block_size // layout.cp
    mixed = p.strategy == "fsdp" and p.mixed_precision != "none" and layout.dp_enabled
    hidden = DTYPES[p.mixed_precision] if mixed else torch.float32
    seq = t // layout.tp if p.sequence_parallel else t

    def residual() -> torch.Tensor:  # requires grad: its gradient travels back to the stage before
        return torch.empty(b, seq, m.n_embd, dtype=hidden, device=device, requires_grad=True)

    first, last = stage == 0, stage == layout.num_stages - 1
    inputs = torch.zeros(b, t, dtype=torch.long, device=device) if first else residual()
    outputs = torch.empty(b, t, 1, dtype=hidden, device=device, requires_grad=True) if last else residual()
    return {"input_args": (inputs,), "output_args": (outputs,)}


def _static_stage(pipeline: Pipeline, module: nn.Module, stage_id: int) -> PipelineStage:
    """Pipeline.make_stage on the fake group (its example tensors are not the launch's: they are
    left out of the construction's bytes)."""
    return _StaticStage(module, stage_id, pipeline.layout.num_stages, pipeline.device, group=pipeline.pp_group,
                        **AllocationPeak.apart(static_stage_args)(pipeline.cfg, pipeline.layout, stage_id,
                                                                  pipeline.device))


class _UncheckedDDP(DistributedDataParallel):
    """DDP without its start-up check: it compares and broadcasts the parameters across ranks,
    and the fake group carries no data."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "init_sync": False})


@contextlib.contextmanager
def fake_world():
    """The seams of the module doc that patch torch and the project's engines for as long as the
    dry run lasts."""
    real_init, real_stage, real_ddp = DeviceMesh.__init__, Pipeline.make_stage, ddp.DistributedDataParallel

    def mesh_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            real_init(self, *args, **kwargs)
    saved = {name: getattr(dist, name) for name in _own_object_back()}
    # DTensor infers an operation's output shape by running it on tensors of a fake mode (its
    # own in a launch, the dry run's here): no memory in a launch, so none in the construction's
    real_meta = ShardingPropagator._propagate_tensor_meta_non_cached
    ShardingPropagator._propagate_tensor_meta_non_cached = AllocationPeak.apart(real_meta)
    DeviceMesh.__init__, Pipeline.make_stage, ddp.DistributedDataParallel = mesh_init, _static_stage, _UncheckedDDP
    for name, fn in _own_object_back().items():
        setattr(dist, name, fn)
    try:
        yield
    finally:
        DeviceMesh.__init__, Pipeline.make_stage, ddp.DistributedDataParallel = real_init, real_stage, real_ddp
        ShardingPropagator._propagate_tensor_meta_non_cached = real_meta
        for name, fn in saved.items():
            setattr(dist, name, fn)


def start_rank(world: int, rank: int) -> DistEnv:
    """The fake process group as `rank` of `world` (any earlier one is destroyed first)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    # DTensor caches sharding decisions by mesh, and a mesh equals the last rank's (same ranks,
    # same names) while its groups are gone: start each simulated rank without them
    _clear_sharding_prop_cache()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    return DistEnv(rank=rank, world_size=world, device=torch.device("cpu"), backend="fake")


def dry_config(cfg: Config, run_dir: Path) -> Config:
    """cfg as the dry run trains it: every step a log step (resident bytes are read there), a
    given peak (no CPU measurement), nothing compiled, the run folder a scratch one."""
    new = copy.deepcopy(cfg)
    t = new.trainer
    t.log_every, t.peak_flops, t.compile, t.device, t.run_dir = 1, 1.0, False, "cpu", str(run_dir)
    return new


def build_rank(cfg: Config, strategy: Strategy, vocab: int, run_dir: Path) -> tuple[Trainer, dict[str, int]]:
    """The real model construction (launch/build.py place_model: meta build, strategy.setup with
    the seed's initial values) and Trainer of the strategy's rank, on fake tensors (call inside
    FakeTensorMode; the strategy and its mesh are built outside, like a launch builds them), with
    the peak bytes the construction allocated: on the rank's device, and in host memory (what the
    initial-value function makes: each whole initial value)."""
    gpt_cfg = GPTConfig.of(cfg.model, vocab)
    with AllocationPeak() as built:
        cost = _place_model(strategy, gpt_cfg, cfg.trainer.seed, built)
    for module in _ddp_modules(strategy):
        module.register_comm_hook(module.process_group, _all_reduce_bucket)
    env = strategy.env
    snapshots = SnapshotManager(run_dir, cfg.trainer.keep_snapshots, env.rank, env.distributed)
    return Trainer(assemble(cfg, FakeData(cfg.model.block_size), None, strategy, run_dir, dataclasses.asdict(gpt_cfg),
                            cost, snapshots)), dict(built.peak)


def _place_model(strategy: Strategy, gpt_cfg: GPTConfig, seed: int, built: AllocationPeak) -> ModelCost:
    """launch/build.py place_model, its meta phase (the GPT on the meta device, the pipeline split,
    tensor parallelism, FSDP2's fully_shard) on real meta tensors, outside FakeTensorMode, as in a
    launch: a parameter made from a fake meta tensor cannot be swapped by `to_empty` (the fake
    mode's converter holds a weak reference to it). From parallel/materialize.py's `materialize`
    on (allocation, initial values, the engine that wraps a replica, the step runner) the fake mode
    is on again, to the end of strategy.setup."""
    fake = active_fake_mode()
    real = parallelize.materialize

    def fake_again(*args, **kwargs):
        if active_fake_mode() is None:
            again.enter_context(fake)
        real(*args, **kwargs)
    parallelize.materialize = fake_again
    try:
        with unset_fake_temporarily(), contextlib.ExitStack() as again:
            return place_model(strategy, gpt_cfg, seed, watch_initial=built.host)
    finally:
        parallelize.materialize = real


def _ddp_modules(strategy: Strategy) -> list[DistributedDataParallel]:
    runner = strategy.runner
    parts = [getattr(runner, "wrapped", None)] + [st.submod for st in getattr(runner, "stages", [])]
    return [m for m in parts if isinstance(m, DistributedDataParallel)]


def _all_reduce_bucket(group, bucket):  # no annotation: DDP compares it with the object, a string here
    """DDP's bucket all-reduce as a comm hook: the fake group's work carries no result tensor,
    which DDP's C++ reducer asserts on; the bucket's all-reduce is issued (and counted) the same."""
    dist.all_reduce(bucket.buffer(), group=group)
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


@dataclass
class RankMeasurement:
    """What one simulated rank holds, saves and issues in one optimizer step."""
    rank: int
    coordinate: tuple[int, ...]  # (pp, dp, tp), and cp under context parallelism
    held: dict[str, int]  # Strategy.resident_bytes: params, grads, optimizer
    activations_per_microbatch: int  # SavedBytes / micro-batches
    calls: list[Call]  # every collective of the step (phase "norm": the gradient norm's)
    groups: dict[tuple[int, ...], str]  # ranks of this rank's groups -> dp | tp | pp | tied
    snapshot_items: int = 0  # DCP save plan: write items of this rank
    snapshot_bytes: int = 0  # bytes of the tensors those items write
    snapshot_calls: list[Call] = field(default_factory=list)  # collectives of building the state dict
    construction: int = 0  # peak bytes allocated on the rank's device while the model was built
    construction_host: int = 0  # peak bytes the initial-value function held meanwhile (whole values)


def measure_rank(cfg: Config, world: int, rank: int, vocab: int) -> RankMeasurement:
    """One simulated rank: build it, run Trainer.train_step once, plan its snapshot."""
    with tempfile.TemporaryDirectory(prefix="dry-run-") as tmp:
        run_dir = Path(tmp)
        cfg = dry_config(cfg, run_dir)
        s = build_strategy(cfg, start_rank(world, rank))
        with FakeTensorMode(allow_non_fake_inputs=True):
            trainer, built = build_rank(cfg, s, vocab, run_dir)
            counter, saved = CollectiveCounter(), SavedBytes()
            with counter, saved.hooks(), norm_phase(s, counter), cp_phase(counter):
                trainer.train_step()
            counter.phase = "snapshot"
            with counter:
                items, nbytes = plan_snapshot(trainer)
        c = s.coordinate
        return RankMeasurement(rank, (c.pp, c.dp, c.tp) + ((c.cp,) if s.layout.cp_enabled else ()),
                               dict(trainer.held_bytes),
                               saved.nbytes // s.layout.microbatches,
                               [k for k in counter.calls if k.phase != "snapshot"], group_names(s),
                               items, nbytes, [k for k in counter.calls if k.phase == "snapshot"],
                               built["device"], built["host"])


def plan_snapshot(trainer: Trainer) -> tuple[int, int]:
    """The snapshot's tensors (Trainer.state_tensors, as SnapshotManager.save splits them) through
    DCP's save planner for this rank: (write items, bytes they write). Nothing is written."""
    tensors, _ = split_state(trainer.state_tensors())
    planner = DefaultSavePlanner()
    with unset_fake_temporarily():  # planning reads shapes and placements; DTensor offsets come from real mesh tensors
        planner.set_up_planner(tensors or {}, storage_meta=None, is_coordinator=trainer.strategy.env.rank == 0)
        plan = planner.create_local_plan()
    nbytes = 0
    for item in plan.items:
        if item.tensor_data is not None:
            size = item.tensor_data.chunk.sizes
            nbytes += int(torch.Size(size).numel()) * item.tensor_data.properties.dtype.itemsize
    return len(plan.items), nbytes


def group_names(strategy) -> dict[tuple[int, ...], str]:
    """Ranks of this rank's groups -> the planner's group name (dp, tp, pp, cp, tied). Under cp the
    engine's group is dp x cp flattened ("dp_cp"), named dp; at dp 1 it has the cp group's ranks."""
    out = {}
    lay = strategy.layout

    def ranks(dim: str) -> tuple[int, ...]:
        return tuple(sorted(dist.get_process_group_ranks(strategy.mesh[dim].get_group())))
    for dim in ("pp", "dp", "tp", "dp_replicate", "dp_shard"):  # the last two: HSDP's sub-groups of dp
        if getattr(lay, dim) > 1 and dim in strategy.mesh.mesh_dim_names + ("dp",):
            out[ranks(dim)] = "dp" if dim.startswith("dp") else dim
    if lay.cp_enabled:
        out[ranks("cp")] = "cp"
        out[ranks("dp_cp")] = "dp"
    tied = getattr(strategy.runner, "tied_group", None)
    if tied is not None:
        out.setdefault(tuple(sorted(dist.get_process_group_ranks(tied))), "tied")
    return out
