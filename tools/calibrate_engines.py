"""The engines' host work, the part of `--hardware local` measured in one process on torch's fake
process group (its collectives return at once, so what remains is each engine's own work on the
host): tools/calibrate.py runs `engines` in the first of its two processes, after their gloo group
is closed.

- tp_overhead: what a tensor-parallel (tp 2) tiny GPT costs per block per micro-batch beyond the
  plain tiny GPT (DTensor dispatch and redistribution);
- vocab_overhead: what the vocabulary-parallel embedding, LM head and loss_parallel cross-entropy
  cost per micro-batch beyond the replicated ones, on the tp 2 tiny GPT (DTensor's dispatch; once a
  step per micro-batch whatever the blocks);
- sp_overhead, sp_elementwise: what sequence parallelism adds to a tp 2 GPT, a fixed part per block
  and one per activation element (tokens x width per block), from the tiny GPT and a wider one
  (`two_part`; its sharded LayerNorms' saving and its redistributions' copies together: the fake
  group copies for sp's gathers and reduce-scatters, not for tp's all-reduces, so a little of what
  gloo's link figures hold is in it too, first order);
- fsdp_overhead, fsdp_copy: what FSDP2 (2 ranks) adds, split into a fixed cost per block (its hooks)
  and one per parameter element (the copies into and out of the gather and reduce-scatter
  buffers, which a tiny model cannot show) from the tiny GPT and a wide shallow one (`two_part`);
- dtensor_optimizer_overhead: fused AdamW's step on FSDP2's DTensor shards beyond the same step on
  plain tensors, per parameter tensor (DTensor's dispatch);
- cp_<mode>_overhead, cp_<mode>_elementwise (per parallel.cp_mode): what context parallelism's attention (cp 2:
  its blocks of the fused kernel, the log-sum-exp merges, the chunks' slicing and concatenation)
  costs per block per micro-batch beyond one fused attention over the same query-key pairs, split
  into a fixed part and a part per activation element (tokens x width) from the tiny GPT and a
  wide one. Its ring here is `LocalRing`, whose peer's blocks are this rank's own (the fake
  group's receive would leave them unwritten, and its reduce-scatter refuses the ring's shapes):
  the same shapes and kernels, the bytes' time left to the collectives' own figures. Measured at
  cp 2; planner/compute.py scales the ring's by cp - 1;
- zero_overhead, zero_copy: what the project's ZeRO-1/2 engine (parallel/zero_shard.py, 2 ranks)
  costs around each reduce-scatter and all-gather, its packing and unpacking of a bucket, per tensor
  and per element, from the tiny GPT and a wide one of 25 MB taking turns (`_zero_copies`), timed while glibc
  keeps the freed memory as trainer.host_memory=reuse does (returned to the kernel at every free,
  the same work measured 5x as long on 1-4 MB tensors: the fresh mappings' page faults);
- plain_step: a whole training step of the plain tiny GPT, whose math takes microseconds;
- fsdp_steps: the FSDP2 tiny GPT's and FSDP_BYTES_MODEL's forward + backward here, where their
  collectives return at once: tools/calibrate.py subtracts them from the same on gloo
  (fsdp_call_costs: a latency per call and a time per byte sent).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from config import ParallelConfig
from model import GPT, GPTConfig, lm_loss
from observe.host_memory import reuse_step_memory
from parallel.cp import Ring, apply_context_parallel
from parallel.fsdp import fully_shard_gpt
from parallel.strategy import decay_groups
from parallel.tp import apply_tensor_parallel
from parallel.zero_shard import ShardPlan, ZeroDataParallel

DEFAULT_BUCKET_MB = ParallelConfig.bucket_cap_mb  # the engine's buckets as a default launch makes them

ENGINE_MODEL = (4, 64, 16, 2)  # blocks, width, positions, sequences of the engine-overhead GPT
ENGINE_VOCAB = 64  # the vocabulary of every GPT timed here
# the second FSDP2 GPT, wide and shallow (its math about a ms): with ENGINE_MODEL it separates FSDP2's
# fixed cost per block from its cost per parameter element (the copies in and out)
ENGINE_WIDE = (2, 256, 16, 2)
# the second cp GPT: each cp rank's 16 sequences of 16 positions, 256 wide (a few ms of math a block)
CP_WIDE = (2, 256, 16, 16)
CP_MODES = ("ring", "allgather")
# the second ZeRO-1/2 GPT: 6.3M parameters, 25 MB, one bucket whose parameters, gradients and
# packed copies together outgrow the 2-core machine's 32 MiB last-level cache, as a model's do
# (ENGINE_MODEL's 0.2M stay in it)
ZERO_WIDE = (2, 512, 16, 2)
# the second FSDP2 GPT timed on gloo (tools/calibrate.py) and here: 2 blocks of 512, 6.3M parameters, 38 MB
# sent by each rank a step in 9 calls, where the tiny GPT sends 1.2 MB in 15: its time on gloo is mostly
# bytes, the tiny one's calls (fsdp_call_costs)
FSDP_BYTES_MODEL = (2, 512, 16, 2)
# the second tp and sp GPT: 8 sequences of 128 positions, 128 wide (131k activation elements a block)
SP_WIDE = (2, 128, 128, 8)
ROUNDS, WARMUP = 20, 3


class LocalRing(Ring):
    """One of 2 cp ranks (rank 1: under allgather it computes 4 blocks of the kernel where rank 0
    computes 3, and the step waits for the slowest; the ring's ranks are alike) whose peer holds
    the same tensors: a shift hands back what it sends (gloo writes the peer's into a buffer
    without this rank's cores copying: the bytes' time is the collectives' own figure), the
    all-gather stacks and the reduce-scatter sums (their outputs are new tensors on gloo too)."""

    def __init__(self, rank: int = 1):  # no process group
        self.group, self.rank, self.size = None, rank, 2

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t, t])

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        return t.sum(0)

    def start_shift(self, tensors, tag: int):
        return lambda: list(tensors)


def engine_gpt(shape: tuple[int, int, int, int], positions: int | None = None) -> GPT:
    layers, width, block, _ = shape
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=ENGINE_VOCAB, block_size=positions or block, n_layer=layers, n_head=4,
                         n_embd=width, dropout=0.0))


def fully_sharded(model: GPT, mesh) -> GPT:
    """`model` under FSDP2 over `mesh`, resharded after forward, by the product's own wrapping
    (parallel/fsdp.py: every block, then the root; on gloo the project's ring reduce-scatter)."""
    return fully_shard_gpt(model, ring_reduce_scatter=dist.get_backend() == "gloo", mesh=mesh,
                           reshard_after_forward=True)


def fsdp_calls(model: GPT) -> int:
    """FSDP2's collective calls in one forward + backward of a `fully_sharded` GPT: per unit (each
    block and the root) an all-gather in forward, another in backward, one reduce-scatter."""
    return 3 * (len(model.blocks) + 1)


def fsdp_sent_bytes(model: GPT) -> int:
    """Bytes one of 2 ranks sends in one forward + backward of a `fully_sharded` GPT: half of the fp32
    parameters per all-gather (two) and per reduce-scatter (one)."""
    return 3 * model.num_params(exclude_position=False) * 4 // 2


def fsdp_steps(shapes: tuple[tuple[int, int, int, int], ...], mesh) -> list[float]:
    """The median forward + backward seconds of a `fully_sharded` GPT of each shape on its tokens,
    ROUNDS after WARMUP, one model after the other: on gloo, with the two taking turns, two
    calibrations put the tiny GPT's calls at 0.99 and 1.61 ms, one after the other three at
    0.69-0.93 (0.7-1.3 in the 24 calibrations of docs/planner.md that timed the tiny one alone)."""
    return [_fsdp_step(fully_sharded(engine_gpt(shape), mesh), engine_tokens(shape)) for shape in shapes]


def _fsdp_step(model: GPT, x: torch.Tensor) -> float:
    """The median forward + backward seconds of `model` on x (the model released on return)."""
    return _interleaved_medians([lambda: lm_loss(model(x), x).backward()])[0]


def fsdp_call_costs(tiny: tuple[float, float], wide: tuple[float, float], busy: float,
                    gather_bandwidth: float, scatter_bandwidth: float) -> tuple[float, float]:
    """(seconds per call, seconds per byte a rank sends) of FSDP2's all-gathers and reduce-scatters
    at 2 ranks on the backend, in FSDP2's own pattern: a GPT's forward + backward under FSDP2 there
    (both ranks computing) less the same on the fake process group (its host work alone, x `busy`)
    is calls x latency + bytes sent x byte time, from the tiny GPT (ENGINE_MODEL: 15 calls, 1.2 MB
    sent a step) and FSDP_BYTES_MODEL (9 calls, 38 MB): each (gloo, fake) seconds, two equations in
    two unknowns. Measured on the 2-core CPU in 40 calibrations: 0.61-1.15 ms a call and 0.93-1.89
    ns a byte (median 1.30), where gloo's own all-gather and all-to-all, timed alone between 6 ms of
    matmuls in the same calibrations, moved 0.96-1.65 and 1.3-2.7 GB/s (0.4-1.0 ns a byte): at those
    rates a deep FSDP2 model's calls were priced below what they cost (docs/planner.md). A noisy pair
    that gives either figure <= 0 keeps what the tiny GPT alone gives: its extra less its bytes at
    gloo's `gather_bandwidth` and `scatter_bandwidth` (bytes a rank sends per second), per call,
    and no byte time (planner/timing.py then prices FSDP2's bytes at those links' rates)."""
    rows = [(gloo - fake * busy, fsdp_calls(model), fsdp_sent_bytes(model))
            for (gloo, fake), model in ((tiny, engine_gpt(ENGINE_MODEL)), (wide, engine_gpt(FSDP_BYTES_MODEL)))]
    latency, byte_time = two_part(*rows)  # either one 0 where the pair is noisy
    if latency > 0 and byte_time > 0:
        return latency, byte_time
    tiny_extra, tiny_calls, tiny_bytes = rows[0]
    # each gather sends a third of the step's bytes, the reduce-scatter one
    wire = tiny_bytes / 3 * (2 / gather_bandwidth + 1 / scatter_bandwidth)
    return max(0.0, (tiny_extra - wire) / tiny_calls), 0.0


def activation_elements(shape: tuple[int, int, int, int]) -> int:
    """Tokens x width summed over the blocks of a GPT of `shape`: what `two_part` counts per
    activation element."""
    layers, width, positions, sequences = shape
    return layers * width * positions * sequences


def engine_tokens(shape: tuple[int, int, int, int], stretch: int = 1) -> torch.Tensor:
    """A rank's tokens for a GPT of `shape` (`stretch` x longer sequences, as many fewer)."""
    return torch.randint(0, ENGINE_VOCAB, (shape[3] // stretch, shape[2] * stretch))


def _context_parallel(shape: tuple[int, int, int, int], mode: str) -> GPT:
    """cp rank 1 of 2 of a GPT whose sequences are twice `shape`'s positions long."""
    model = engine_gpt(shape, 2 * shape[2])
    apply_context_parallel(model, LocalRing(), mode)
    return model


def _interleaved_medians(calls: list, rounds: int = ROUNDS) -> list[float]:
    """The median seconds of each call over `rounds` rounds, one call of each in turn, after WARMUP
    rounds (DTensor's sharding caches, FSDP2's lazy init, the optimizers' state)."""
    times: list[list[float]] = [[] for _ in calls]
    for round_ in range(rounds + WARMUP):
        for call, t in zip(calls, times):
            seconds = timed(call)
            if round_ >= WARMUP:
                t.append(seconds)
    return [sorted(t)[len(t) // 2] for t in times]


def _medians(models: dict[str, tuple[torch.nn.Module, torch.Tensor]], vocab_parallel: tuple[str, ...] = ()) -> dict[str, float]:
    """The median forward + backward seconds of each (model, input), one step of each in turn; those
    named in `vocab_parallel` under loss_parallel, as parallel/step.py runs a vocabulary-parallel head."""
    def step(model, x, sharded_logits: bool) -> None:
        with loss_parallel() if sharded_logits else contextlib.nullcontext():
            lm_loss(model(x), x).backward()
    steps = [lambda name=name, model=model, x=x: step(model, x, name in vocab_parallel)
             for name, (model, x) in models.items()]
    return dict(zip(models, _interleaved_medians(steps)))


def engines(threads: int) -> dict:
    """Rank 0 of 2 on the fake process group: each model's median over interleaved rounds, per
    block the extra over its plain twin (sequence parallelism's over the tp model; never below 0)."""
    torch.set_num_threads(threads)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = init_device_mesh("cpu", (2,))

    small, wide, cp_wide, sp_wide = (engine_tokens(shape) for shape in (ENGINE_MODEL, ENGINE_WIDE, CP_WIDE, SP_WIDE))
    models = {"plain": (engine_gpt(ENGINE_MODEL), small), "tp": (apply_tensor_parallel(engine_gpt(ENGINE_MODEL), mesh), small),
              "sp": (apply_tensor_parallel(engine_gpt(ENGINE_MODEL), mesh, sequence_parallel=True), small),
              "tp vocab": (apply_tensor_parallel(engine_gpt(ENGINE_MODEL), mesh, vocab_parallel=True), small),
              "tp wide": (apply_tensor_parallel(engine_gpt(SP_WIDE), mesh), sp_wide),
              "sp wide": (apply_tensor_parallel(engine_gpt(SP_WIDE), mesh, sequence_parallel=True), sp_wide),
              "fsdp": (fully_sharded(engine_gpt(ENGINE_MODEL), mesh), small),
              "fsdp bytes": (fully_sharded(engine_gpt(FSDP_BYTES_MODEL), mesh), engine_tokens(FSDP_BYTES_MODEL)),
              "plain wide": (engine_gpt(ENGINE_WIDE), wide), "fsdp wide": (fully_sharded(engine_gpt(ENGINE_WIDE), mesh), wide),
              # the same tokens and query-key pairs as a cp rank's (the zigzag split gives each rank
              # the same pairs: planner/compute.py attention_flops): half the sequences, twice as long
              "plain cp": (engine_gpt(ENGINE_MODEL, 2 * ENGINE_MODEL[2]), engine_tokens(ENGINE_MODEL, 2)),
              "plain cp wide": (engine_gpt(CP_WIDE, 2 * CP_WIDE[2]), engine_tokens(CP_WIDE, 2))}
    for mode in CP_MODES:
        models[f"cp {mode}"] = (_context_parallel(ENGINE_MODEL, mode), small)
        models[f"cp {mode} wide"] = (_context_parallel(CP_WIDE, mode), cp_wide)
    median = _medians(models, vocab_parallel=("tp vocab",))
    tp = max(0.0, (median["tp"] - median["plain"]) / ENGINE_MODEL[0])
    # one micro-batch, once whatever the blocks; the head's halved matmul (V / t rows) is in the
    # difference too, a saving of microseconds at this vocabulary and width, which the planner
    # prices apart through its FLOPs
    vocab = max(0.0, median["tp vocab"] - median["tp"])
    # what sequence parallelism adds to tp's, per block and per activation element of its blocks
    sp = two_part(*((median[f"sp{w}"] - median[f"tp{w}"], shape[0], activation_elements(shape))
                    for w, shape in (("", ENGINE_MODEL), (" wide", SP_WIDE))))
    fsdp, copy = two_part(*((median[f"fsdp{w}"] - median[f"plain{w}"], shape[0], models[f"plain{w}"][0].num_params(
        exclude_position=False)) for w, shape in (("", ENGINE_MODEL), (" wide", ENGINE_WIDE))))
    cp = {mode: two_part(*((median[f"cp {mode}{w}"] - median[f"plain cp{w}"], shape[0], activation_elements(shape))
                           for w, shape in (("", ENGINE_MODEL), (" wide", CP_WIDE)))) for mode in CP_MODES}
    optimizer = _dtensor_optimizer(models["fsdp"][0])
    plain_step = _plain_step(engine_gpt(ENGINE_MODEL), small)
    # last: reuse_step_memory leaves glibc at main.py's lean setting, not where it found it
    zero_overhead, zero_copy = two_part(*_zero_copies([engine_gpt(shape) for shape in (ENGINE_MODEL, ZERO_WIDE)]))
    dist.destroy_process_group()
    return {"tp_overhead": tp, "vocab_overhead": vocab, "sp_overhead": sp[0], "sp_elementwise": sp[1], "fsdp_overhead": fsdp, "fsdp_copy": copy,
            "dtensor_optimizer_overhead": optimizer, "plain_step": plain_step,
            # FSDP2's host work alone, which tools/calibrate.py takes from the same on gloo (fsdp_call_costs)
            "fsdp_steps": (median["fsdp"], median["fsdp bytes"]),
            "zero_overhead": zero_overhead, "zero_copy": zero_copy,
            **{f"cp_{mode}_overhead": cp[mode][0] for mode in CP_MODES},
            **{f"cp_{mode}_elementwise": cp[mode][1] for mode in CP_MODES}}


def two_part(tiny: tuple[float, int, int], wide: tuple[float, int, int]) -> tuple[float, float]:
    """(seconds per block, seconds per element) an engine adds to a micro-batch's forward + backward,
    from two models' (extra seconds, blocks or tensors, elements): extra = count x fixed + elements x
    per_element, two equations in two unknowns. FSDP2's elements are its parameter elements (the
    copies in and out of its buffers; by hand on the fake process group, docs/planner.md: 1.2-1.3 ms
    a block at 64 wide, 3-7.7 ms at 256-512 wide), context parallelism's and sequence
    parallelism's the activation elements their blocks go through (tokens x width per block),
    ZeRO-1/2's (counting tensors, not blocks) its parameter elements. The fixed part is the host work the tiny
    model's extra is nearly all of. A noisy pair that gives a negative part keeps the other alone
    (never below 0)."""
    (e1, b1, n1), (e2, b2, n2) = tiny, wide
    det = b1 * n2 - b2 * n1
    fixed, per_element = (e1 * n2 - e2 * n1) / det, (b1 * e2 - b2 * e1) / det
    if per_element <= 0:
        return max(0.0, e1 / b1), 0.0
    if fixed <= 0:
        return 0.0, max(0.0, e2 / n2)
    return fixed, per_element


def _dtensor_optimizer(sharded: GPT, rounds: int = 15) -> float:
    """Seconds per parameter tensor that fused AdamW's step on FSDP2's DTensor shards takes beyond
    the same step on plain tensors of the shards' size (parallel/strategy.py fuses both): the
    median of interleaved rounds, never below 0."""
    params = list(sharded.parameters())
    for p in params:  # the fake group's reduce-scatter writes nothing: gradients of a known value
        p.grad = None if p.grad is None else p.grad.zero_()
    local = [torch.nn.Parameter(p.to_local().detach().clone()) for p in params]
    for p, q in zip(local, params):
        p.grad = torch.zeros_like(p) if q.grad is None else q.grad.to_local().detach().clone()
    dtensor, tensors = _interleaved_medians([torch.optim.AdamW(ps, lr=1e-4, fused=True).step for ps in (params, local)],
                                            rounds)
    return max(0.0, (dtensor - tensors) / len(params))


def _zero_copies(models: list[GPT], rounds: int = 9) -> list[tuple[float, int, int]]:
    """Per model, (seconds, tensors, elements) of one ZeRO-1/2 collective's packing and unpacking:
    rank 0 of 2 on the fake process group reduces every bucket and gathers the parameters back as
    parallel/zero_shard.py does in a step; the median of `rounds` (after WARMUP, the models taking
    turns) over the two collectives, under trainer.host_memory=reuse's glibc setting. The fake
    group's calls return at once but copy as a backend would: its all-gather fills every chunk with
    this rank's, its reduce-scatter copies this rank's chunk (about 12 bytes an element for the
    two). On gloo the project's reduce-scatter sums the received rows instead (parallel/collectives.py,
    about 10 bytes), which the fake group's branch skips: first order, one stands for the other."""
    steps = []
    for model in models:
        plan = ShardPlan([model], decay_groups([model], 0.1), 2, 0, DEFAULT_BUCKET_MB, dist.group.WORLD)
        wrapped = ZeroDataParallel(model, plan, keep_full_grads=True)  # stage 1: the gradients stay for the next round
        for p in model.parameters():
            p.grad = torch.randn_like(p)

        def reduce_and_gather(plan=plan, wrapped=wrapped):
            for bucket in plan.buckets:
                wrapped._reduce(bucket)
            plan.gather_params()
        steps.append(reduce_and_gather)
    with reuse_step_memory():
        seconds = _interleaved_medians(steps, rounds)
    return [(s / 2, len(list(m.parameters())), m.num_params(exclude_position=False)) for s, m in zip(seconds, models)]


def _plain_step(model: GPT, x: torch.Tensor) -> float:
    """The median seconds of a whole training step of the tiny GPT as parallel/strategy.py runs an
    unsharded one: forward, loss, backward, the gradient norm and clip, fused AdamW, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    for round_ in range(ROUNDS + WARMUP):
        t0 = time.perf_counter()
        lm_loss(model(x), x).backward()
        grads = [p.grad for p in model.parameters()]
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.nn.utils.get_total_norm(grads, 2.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if round_ >= WARMUP:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def timed(fn) -> float:
    """The seconds one call of `fn` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
