"""The layout of one launch: how many ranks run each parallel dimension, and every rule that
depends on the world size.

Owns `Layout` (in the spirit of torchtitan's ParallelDims): the degrees pp x dp (x cp) x tp, the batch
split they imply (per-rank batch, micro-batches per step), the pipeline's stage placement, the
rank at a mesh coordinate, and `Layout.of`, the one check of everything a world size can get wrong. It is
pure arithmetic on the config: `Layout.of(cfg, world_size)` runs before any process group,
model or strategy exists, so a bad launch is refused in one line before any work. The named
DeviceMesh is built from it (`build_mesh`) and nothing else computes ranks.

Mesh order is ("pp", "dp", "tp") with tp innermost: tensor parallelism talks twice per block, so
its ranks should be neighbours (same host, NVLink); pipeline stages talk least, so they are
outermost. dp = world_size / (tp * pp). Global rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
With context parallelism (cp > 1: each sequence split over cp ranks, parallel/cp.py) the mesh is
("pp", "dp", "cp", "tp"): cp passes K/V blocks every layer, less than tp and more than dp. Then
dp = world_size / (tp * pp * cp), global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp +
tp_rank, and "dp_cp" (dp and cp flattened) is where gradients are averaged: the cp ranks of a
sequence hold the same parameters, each with the gradient of its own tokens.

Config-only checks (heads divisible by tp, a pipeline split that adds up, options that belong to
another strategy) are parallel/options.py's; the checks here need the world size.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from config import Config, UsageError
from parallel.env import GPU_GROUP_BACKEND, time_out_mesh
from parallel.options import Engine, world_size_problem

MESH_DIMS = ("pp", "dp", "tp")
CP_MESH_DIMS = ("pp", "dp", "cp", "tp")
# With parallel.dp_replicate = R > 1 (HSDP) dp is built as (R, dp / R) and flattened back into "dp".
HSDP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
# Data-parallel engines that hold plain tensors only: they cannot take tensor-parallel (DTensor)
# parameters when dp > 1 (DDP broadcasts and reduces plain tensors: measured), and ZeRO-1/2's own
# element sharding splits plain tensors (ZeRO-3 is FSDP2, which composes with tp and pp).
_PLAIN_TENSOR_ENGINES = (Engine.DDP, Engine.ZERO1, Engine.ZERO2)


@dataclass(frozen=True)
class Coordinate:
    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    tp: int
    batch_size: int  # global: sequences per optimizer step
    microbatches: int  # forward/backward passes per optimizer step on one rank (accumulation or pipeline)
    num_stages: int = 1  # pipeline stages, pp x parallel.pp_stages_per_rank
    stage_blocks: tuple[int, ...] = ()  # transformer blocks per stage
    stage_placement: tuple[int, ...] = (0,)  # stage -> pp rank
    v_shape: bool = False  # ZB-V: rank r holds stages r and S-1-r
    dp_replicate: int = 1  # HSDP: dp = dp_replicate x dp_shard (FSDP2 shards over dp_shard only)
    cp: int = 1  # context parallel: ranks each sequence is split over

    # ------------------------------------------------------------------ building and checking

    @classmethod
    def of(cls, cfg: Config, world_size: int) -> "Layout":
        """The layout of `cfg` on `world_size` ranks, or a UsageError naming what does not fit."""
        p, t = cfg.parallel, cfg.trainer
        if blocker := world_size_problem(world_size, p.tp, p.pp, p.cp):
            raise UsageError(blocker)
        dp = world_size // (p.tp * p.pp * p.cp)
        if p.strategy == "dp" and world_size > 1:
            raise UsageError(f"parallel.strategy=dp drives all GPUs from ONE process but this launch has "
                             f"{world_size} processes; run `python main.py parallel.strategy=dp` "
                             f"or use parallel.strategy=ddp under torchrun")
        if p.strategy == "none" and dp > 1:
            # Each dp rank would train its own copy on its own slice of the batch, never
            # synchronised: a different model from one process, with nothing to show it.
            raise UsageError(f"parallel.strategy=none has no data parallelism but this launch has {dp} "
                             f"data-parallel ranks (world size {world_size} / (tp x pp = {p.tp * p.pp})), "
                             f"which would train {dp} unsynchronised copies; use parallel.strategy=ddp, "
                             f"zero or fsdp, or launch tp x pp = {p.tp * p.pp} processes")
        if dp % p.dp_replicate:
            raise UsageError(f"parallel.dp_replicate={p.dp_replicate} does not divide the {dp} data-parallel ranks "
                             f"(world size {world_size} / (tp x pp)); use a divisor of {dp}")
        if t.batch_size % dp:
            raise UsageError(f"trainer.batch_size={t.batch_size} is not divisible by the "
                             f"{dp} data-parallel ranks; use a multiple of {dp}")
        per_rank = t.batch_size // dp
        plain_tensors = Engine.of(p) in _PLAIN_TENSOR_ENGINES
        if p.strategy == "zero" and plain_tensors and (p.tp > 1 or p.pp > 1):
            raise UsageError(f"parallel.zero_stage={p.zero_stage} shards plain tensors and does not compose "
                             f"with parallel.tp/pp > 1; use parallel.zero_stage=3 or parallel.strategy=fsdp")
        if plain_tensors and p.tp > 1 and dp * p.cp > 1:  # under cp the engine runs on dp x cp
            ranks = f"{dp} dp ranks" if p.cp == 1 else f"dp x cp = {dp * p.cp} ranks"
            raise UsageError(f"parallel.strategy={p.strategy} cannot data-parallelize tensor-parallel "
                             f"(DTensor) parameters; with parallel.tp > 1 and {ranks} use "
                             f"parallel.strategy=fsdp")
        if p.pp > 1:
            layout = cls._pipeline(cfg, dp, per_rank)
        else:
            micro = t.micro_batch_size or per_rank
            if per_rank % micro:
                raise UsageError(f"trainer.micro_batch_size={t.micro_batch_size} does not divide the "
                                 f"per-rank batch {per_rank} (= batch_size / dp ranks); pick a "
                                 f"divisor of {per_rank}")
            layout = cls(pp=1, dp=dp, tp=p.tp, batch_size=t.batch_size, microbatches=per_rank // micro,
                         stage_blocks=(cfg.model.n_layer,), dp_replicate=p.dp_replicate, cp=p.cp)
        if p.static_graph and layout.microbatches > 1:
            # torch DDP bug (pytorch#143580, fix pending in #187732): static_graph with no_sync()
            # asserts in the reducer on the first backward, and once past that stops reducing.
            raise UsageError(f"parallel.static_graph=true cannot be combined with gradient accumulation "
                             f"({layout.microbatches} micro-batches per step; DDP bug pytorch#143580); "
                             f"set trainer.micro_batch_size=0 or parallel.static_graph=false")
        return layout

    @classmethod
    def _pipeline(cls, cfg: Config, dp: int, per_rank: int) -> "Layout":
        """Stage split and placement, and the pipeline micro-batches M of one schedule step."""
        p, t = cfg.parallel, cfg.trainer
        stages = p.pp * p.pp_stages_per_rank
        blocks = tuple(int(v) for v in p.pp_split.split(",")) if p.pp_split else (cfg.model.n_layer // stages,) * stages
        v_shape = p.pp_schedule == "zero_bubble" and p.pp_stages_per_rank == 2
        placement = generate_stage_to_rank_mapping(p.pp, stages, style="v" if v_shape else "loop")
        m = p.microbatches or (max(1, per_rank // t.micro_batch_size) if t.micro_batch_size else p.pp)
        if per_rank % m:
            raise UsageError(f"the per-rank batch {per_rank} (= trainer.batch_size / dp) does not split "
                             f"into {m} pipeline micro-batches; make trainer.batch_size a multiple of "
                             f"{m} x dp or change parallel.microbatches")
        if t.micro_batch_size and t.micro_batch_size * m != per_rank:
            raise UsageError(f"trainer.micro_batch_size={t.micro_batch_size} x parallel.microbatches={m} != "
                             f"per-rank batch {per_rank}: under pp one optimizer step is one pipeline "
                             f"schedule; set trainer.micro_batch_size=0 or {per_rank // m}")
        if p.pp_schedule != "gpipe" and m < p.pp:  # an explicit count is refused with the config already
            raise UsageError(f"parallel.pp_schedule={p.pp_schedule} needs parallel.microbatches >= pp = {p.pp} "
                             f"(got {m}); raise parallel.microbatches or use gpipe")
        rounds = max(1, m // p.pp)
        if p.pp_stages_per_rank > 1 and m % rounds:
            raise UsageError(f"parallel.pp_schedule={p.pp_schedule} with {p.pp_stages_per_rank} stages per "
                             f"rank runs micro-batches in rounds of pp: parallel.microbatches={m} must be "
                             f"a multiple of {rounds}; use a multiple of pp={p.pp}")
        engine_ranks = dp * (p.cp if p.strategy != "none" else 1)  # an engine averages over dp x cp
        if p.pp_schedule == "zero_bubble" and engine_ranks > 1:
            # Measured: split input/weight backward passes leave DDP's all-reduce and FSDP's
            # reduce-scatter with wrong or missing gradients (torch 2.13); under cp the engine
            # runs on dp x cp (measured with ddp: the first step's gradient norm 19% off).
            over = f"{dp} dp ranks" if p.cp == 1 else f"dp x cp = {engine_ranks} ranks under parallel.strategy={p.strategy}"
            raise UsageError("parallel.pp_schedule=zero_bubble does not compose with data parallelism "
                             f"({over}): use 1f1b or interleaved_1f1b, or dp = 1"
                             f"{'' if p.cp == 1 else ' and parallel.strategy=none'}")
        return cls(pp=p.pp, dp=dp, tp=p.tp, batch_size=t.batch_size, microbatches=m, num_stages=stages,
                   stage_blocks=blocks, stage_placement=tuple(placement[s] for s in range(stages)),
                   v_shape=v_shape, dp_replicate=p.dp_replicate, cp=p.cp)

    # ------------------------------------------------------------------ degrees and batch split

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def grad_ranks(self) -> int:
        """The ranks over which gradients are averaged (the data-parallel engine's): dp, x cp under cp."""
        return self.dp * self.cp

    @property
    def grad_dim(self) -> str:
        """The mesh dimension over which gradients are averaged: "dp", or "dp_cp" under cp (the cp
        ranks of a sequence hold the same parameters, each with its own tokens' gradient)."""
        return "dp_cp" if self.cp_enabled else "dp"

    @property
    def dp_shard(self) -> int:
        """Ranks FSDP2 shards over: dp, or dp / dp_replicate under HSDP."""
        return self.dp // self.dp_replicate

    @property
    def per_rank_batch(self) -> int:
        """Sequences of the global batch that one dp rank (all its pp/tp peers together) trains on."""
        return self.batch_size // self.dp

    @property
    def micro_batch_size(self) -> int:
        return self.per_rank_batch // self.microbatches

    # ------------------------------------------------------------------ ranks

    def coordinate(self, rank: int) -> Coordinate:
        """(pp, dp, tp, cp) position of a global rank in the mesh."""
        return Coordinate(pp=rank // (self.dp * self.cp * self.tp), dp=rank // (self.cp * self.tp) % self.dp,
                          tp=rank % self.tp, cp=rank // self.tp % self.cp)

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def stages_of(self, pp_rank: int) -> list[int]:
        """The pipeline stages a pp rank holds, in stage order."""
        return [s for s, r in enumerate(self.stage_placement) if r == pp_rank]

    @property
    def tracker_rank(self) -> int:
        """Global rank of the one process that writes metrics and talks to wandb: it holds the
        reduced loss (the first rank of the last pipeline stage; global rank 0 without pp)."""
        return self.rank_of(pp=self.stage_placement[-1])

    def build_mesh(self, device_type: str, distributed: bool) -> DeviceMesh | None:
        """Collective. The named 3-D DeviceMesh ("pp", "dp", "tp") (4-D with cp, "dp_cp" flattened), or None for a single process.
        Under HSDP it is 4-D, ("pp", "dp_replicate", "dp_shard", "tp"), with the two data-parallel
        dimensions also flattened into "dp" (rank-major, so dp rank = replica x dp_shard + shard,
        the same coordinate as without HSDP: the batch split does not change)."""
        if not distributed:
            return None
        names = MESH_DIMS if self.dp_replicate == 1 else HSDP_MESH_DIMS
        shape = (self.pp, self.dp, self.tp) if self.dp_replicate == 1 else (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        if self.cp_enabled:  # cp does not take HSDP yet (parallel/options.py)
            names, shape = CP_MESH_DIMS, (self.pp, self.dp, self.cp, self.tp)
        # On CUDA every sub-group gets gloo beside NCCL, as the default group has (parallel/env.py):
        # CPU tensors cross sub-groups too (FSDP2's CPU-offloaded gradients in the norm over dp).
        # Left to itself, init_device_mesh splits the default group's NCCL communicator
        # (split_group), and the sub-groups have NCCL alone.
        gpu = device_type == "cuda"
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names,
                                backend_override={name: GPU_GROUP_BACKEND for name in names} if gpu else None)
        if self.dp_replicate > 1:  # torchtitan flattens the same way (private API, torch 2.13)
            mesh["dp_replicate", "dp_shard"]._flatten("dp", backend_override=GPU_GROUP_BACKEND if gpu else None)
        if self.cp_enabled:
            mesh["dp", "cp"]._flatten("dp_cp", backend_override=GPU_GROUP_BACKEND if gpu else None)
        time_out_mesh(mesh)
        return mesh


def describe(cfg: Config, layout: Layout, dp_engine: str) -> str:
    """Each mesh dimension with what runs on it, e.g. 'pp 2 (1f1b, 4 micro-batches) x dp 2 (ddp
    (...)) x tp 2 (megatron ...)'. `dp_engine` names the data-parallel strategy; it acts on the
    dp dimension only, so a dp of 1 does not name it: a tp=2 run is not 'ddp'."""
    p = cfg.parallel
    pp = "pp 1"
    if layout.pp_enabled:
        per_rank = f", {p.pp_stages_per_rank} stages per rank" if p.pp_stages_per_rank > 1 else ""
        pp = f"pp {layout.pp} ({p.pp_schedule}, {layout.microbatches} micro-batches{per_rank})"
    dp = f"dp {layout.dp} ({dp_engine})" if layout.dp_enabled else "dp 1"
    tp = "tp 1"
    if layout.tp_enabled:
        extras = (", vocab-parallel embedding + loss" if p.tp_vocab_parallel else "") + \
                 (", sequence parallel" if p.sequence_parallel else "")
        tp = f"tp {layout.tp} (megatron column/row split of every block{extras})"
    if layout.cp_enabled:
        cp = (f"cp {layout.cp} ({p.cp_mode} attention, load-balanced chunks; gradients averaged over dp x cp"
              f"{' by ' + p.strategy if p.strategy != 'none' else ''})")
        return f"{pp} x {dp} x {cp} x {tp}"
    return f"{pp} x {dp} x {tp}"
