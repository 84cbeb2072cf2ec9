"""`--hardware local`: this machine's figures, measured once and cached per machine.

- peak FLOP/s: the best matmul rate of one process in the training's dtype (observe/perf.py's CPU
  peak, cached in its own file);
- the link: a gloo all-reduce between 2 local processes (started here, holding the machine-wide
  multi-process lock of tools/processes.py), each call after a few ms of matmuls as in a step, the
  mean counted: a 4 KB all-reduce gives the latency per ring step (2 ranks: 2 steps), an 8 MB
  one the bandwidth (2 ranks: each sends K); the 4 KB call again right after the previous one,
  its near latency, and the compute before each call of the first (latency_gap);
- memory bandwidth: the best copy of a 64 MB tensor (the optimizer step streams model state);
- block overhead: forward + backward of one tiny GPT block, whose FLOPs take microseconds: what
  remains is the per-operator cost every block pays whatever its size (Python, dispatch, threads);
- engine overheads: what tensor, sequence, FSDP2 and context parallelism (and tp's
  vocabulary-parallel head) cost beyond a plain GPT,
  timed in one process on torch's fake process group (tools/calibrate_engines.py);
- FSDP2's calls on gloo: the tiny GPT and a wide one under FSDP2 on the 2 processes' gloo group,
  less the same on the fake process group: a latency per call and a time per byte sent
  (fsdp_call_latency, fsdp_byte_time; tools/calibrate_engines.py fsdp_call_costs);
- weight pass: what each matmul call costs for its weight whatever its rows (the kernel packs or
  streams it once a call), per weight element per micro-batch: a 4-block stack at 64 and at 256
  wide, 16 x 32 tokens as 8 micro-batches against 1, the slope of the extra over the weights
  (weight_pass_rate); the same FLOPs in a pipeline's micro-batches cost more;
- compute efficiency and element-wise cost: forward + backward of a 256-wide and a 64-wide block
  on the same 8 x 128 tokens, less the block overhead and one weight pass: the matmuls' fraction of the peak and the
  seconds per activation element of the rest (LayerNorm, GELU, softmax, adds), two equations in
  two unknowns (compute_rates). One efficiency alone, measured at 256 wide, priced a narrow
  model's element-wise work by its FLOPs, too little: the 2-process grid of
  benchmarks/step_time_grid.py measured up to 1.6x the prediction at width 64;
- step overhead: a whole training step of that tiny GPT (forward, loss, backward, the clip, fused
  AdamW, zero_grad) less its blocks' fixed cost: the work every step pays outside the blocks;
- split backward: torch's zero-bubble schedules split each stage's backward into an input half
  and a weight half (torch.distributed.pipelining's stage_backward_input and
  stage_backward_weight: a walk of the autograd graph for the parameter groups, then one
  autograd call per group); the two halves cost more than one full backward, measured through
  torch's own schedules on a 2-block stage at two sizes (measure_split, split_rates): a fixed
  cost per block per micro-batch and one per activation element (about 0.7 ms a block at 64
  wide x 4 x 64 tokens, 1.4 ms at 256 wide x 4 x 128, on full backwards of 1.2 and 22 ms a block);
- busy-node slowdown: a block's forward + backward while both calibration processes compute, over
  the same alone (the cores share the memory system: 1.016 calibrated on the 2-core machine, 1.02-1.03
  by hand on 256-wide blocks).

Every figure is measured with the threads of one rank of a local launch (planner/local_hardware.py
worker_threads: torchrun's OMP_NUM_THREADS=1 unless the environment sets it), whatever the calling
shell's threads. All but the peak are cached in `local-hardware.json` beside the CPU peak cache
(observe.perf.peak_cache_path, $MINGPT_PEAK_CACHE), keyed like it by CPU model, threads and torch
version: planner/local_hardware.py reads them, and calls `measure_local` only where its caller
passes it (`python main.py --plan`; a launch never measures).
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
from torch.testing._internal.distributed.fake_pg import FakeStore

from model import Block, GPTConfig
from observe.perf import cpu_peak
from tools.calibrate_engines import (
    ENGINE_MODEL,
    ENGINE_VOCAB,
    FSDP_BYTES_MODEL,
    engines,
    fsdp_call_costs,
    fsdp_steps,
    timed,
)
from tools.processes import child_env, multiprocess_lock

EFFICIENCY_BLOCK = (256, 128, 8)  # width, positions, sequences of the block that measures compute efficiency
NARROW_WIDTH = 64  # the second block (same positions and sequences) that separates the element-wise work
SPLIT_STAGES = ((64, 64, 4), (256, 128, 4))  # width, positions, sequences of the stages timed by split_rates
SPLIT_BLOCKS = 2  # blocks in each of those stages
SPLIT_MICROBATCHES = 4  # micro-batches of the schedules that time them
SMALL, LARGE = 1024, 2 * 2**20  # float32 elements of the latency (4 KB) and the bandwidth (8 MB) all-reduce
LINK_KINDS, LINK_ROUNDS = ("all-reduce", "all-gather", "all-to-all"), 4
PASS_WIDTHS = (64, 256)  # widths of the two block stacks that measure weight_pass_rate
PASS_STACK = (4, 32, 16, 8)  # their blocks, positions, sequences, and the micro-batches split against one
GAP_MATMULS = 20  # 256 x 256 matmuls before each far call of the link (about 6 ms on one core: latency_gap records it)


def measure_local() -> dict:
    weight_pass = weight_pass_rate()
    # the 32-wide block's time less its one pass over its 12 x 32^2 weights (priced apart)
    overhead = max(0.0, measure_block(32, 16, 1, repeats=20) - block_matmul_weights(32) * weight_pass)
    efficiency, elementwise = compute_rates(overhead, weight_pass)
    figures = measure_link_and_engines()
    # the step's fixed cost outside the blocks (embedding, head and loss, clip, the optimizer's
    # per-tensor work, zero_grad): the tiny GPT's whole step less its blocks' fixed cost and its
    # matmuls' passes over their weights (the blocks' 12 w^2 each, the head's vocabulary x w)
    layers, width = ENGINE_MODEL[:2]
    passes = (layers * block_matmul_weights(width) + ENGINE_VOCAB * width) * weight_pass
    step_overhead = max(0.0, figures.pop("plain_step") - layers * overhead - passes)
    split_overhead, split_elementwise = split_rates()
    return {**figures, "memory_bandwidth": measure_memory_bandwidth(), "block_overhead": overhead,
            "compute_efficiency": efficiency, "step_overhead": step_overhead, "elementwise": elementwise,
            "split_backward_overhead": split_overhead, "split_backward_elementwise": split_elementwise,
            "weight_pass": weight_pass}


def block_matmul_weights(width: int) -> int:
    """A GPT block's matmul weight elements: q, k, v and the projection 4 w^2, the MLP 8 w^2."""
    return 12 * width * width


def compute_rates(overhead: float, weight_pass: float = 0.0) -> tuple[float, float]:
    """(compute efficiency, seconds per activation element per block) from two blocks of the same
    tokens, EFFICIENCY_BLOCK's width and NARROW_WIDTH's: less the fixed overhead and the one pass
    over its 12 w^2 weights (`weight_pass_rate`, priced apart per micro-batch), each block takes

        t_w - overhead - 12 w^2 x weight_pass = 3 F_w tokens / (peak x efficiency) + tokens x w x elementwise

    (F_w = 24 w^2 + 4 s w forward FLOPs per token: the matmuls at the peak's efficiency; the
    element-wise work, LayerNorms, GELU, softmax, residual and bias adds, in proportion to the
    activation's width), two equations for the two unknowns. Without the second term a narrow
    model's element-wise work, a larger share of its step, goes unpriced (measured on the
    2-process grid, benchmarks/step_time_grid.py). A noisy pair that gives a negative
    element-wise cost falls back to the wide block's efficiency alone; one faster than the peak
    is clamped to it."""
    width, positions, sequences = EFFICIENCY_BLOCK
    tokens, peak = positions * sequences, cpu_peak("fp32")[0]
    flops = {w: 3 * tokens * (24 * w * w + 4 * positions * w) / peak for w in (width, NARROW_WIDTH)}
    # one width after the other, each its best of a few: tried instead on 2026-11-28, the widths
    # taking turns as the best of 7 rounds of 3 (efficiency 0.96-1.0 in a grid's 8 calibrations)
    # and as the median of 9 rounds (0.81-0.91): their grids had 36 and 24 of 112 rows outside
    # 20%, this way's 10 and 11 (before the clamp below; docs/planner.md, the grid)
    busy = {w: max(measure_block(w, positions, sequences, repeats=3 if w == width else 7) - overhead
                   - block_matmul_weights(w) * weight_pass, 1e-9) for w in (width, NARROW_WIDTH)}
    # t = a x + n c, with x = 1 / efficiency, c = elementwise, n = tokens x w
    (a1, n1, t1), (a2, n2, t2) = ((flops[w], tokens * w, busy[w]) for w in (width, NARROW_WIDTH))
    det = a1 * n2 - a2 * n1
    x, c = (t1 * n2 - t2 * n1) / det, (a1 * t2 - a2 * t1) / det
    if x < 1:  # the matmuls at or above the peak's rate (a peak measured on a slow minute): at it,
        # and the rest of both blocks element-wise (least squares); falling back to efficiency
        # alone here priced 5 of one grid's 8 calibrations at 0 ns
        x = 1.0
        c = (n1 * (t1 - a1) + n2 * (t2 - a2)) / (n1 * n1 + n2 * n2)
    if c <= 0:
        return min(1.0, a1 / t1), 0.0
    return 1 / x, c


def weight_pass_rate(rounds: int = 7) -> float:
    """Seconds per matmul weight element per micro-batch (the hardware's weight_pass): each matmul
    call packs or streams its weight whatever its rows, so the same tokens in more micro-batches
    cost more at the same FLOPs. `measure_pass` at PASS_WIDTHS: each extra block-micro-batch costs
    a fixed part (the block overhead's) + the block's weight elements x weight_pass, two equations
    for the slope. A noisy pair that gives a negative slope gives 0 (not priced)."""
    (n1, e1), (n2, e2) = (measure_pass(w, rounds) for w in PASS_WIDTHS)
    return max(0.0, (e2 - e1) / (n2 - n1))


def measure_pass(width: int, rounds: int) -> tuple[int, float]:
    """(a block's matmul weight elements, the seconds each extra micro-batch costs a block): a
    PASS_STACK stack of blocks' forward + backward over the same tokens split into its micro-batches
    against one, the median of interleaved rounds, per block per extra micro-batch."""
    blocks, positions, sequences, micro = PASS_STACK
    stack = torch.nn.Sequential(*[Block(GPTConfig(block_size=positions, n_embd=width, n_head=4, dropout=0.0))
                                  for _ in range(blocks)])
    x = torch.randn(sequences, positions, width)

    def step(m: int) -> None:
        for chunk in x.chunk(m):
            stack(chunk).sum().backward()
    def split_less_whole(r: int) -> float:
        # the two orders take turns: neither always runs on the caches the other left
        order = (micro, 1) if r % 2 else (1, micro)
        times = {m: timed(lambda m=m: step(m)) for m in order}
        return times[micro] - times[1]
    step(1), step(micro)  # warm-up
    extra = sorted(split_less_whole(r) for r in range(rounds))
    weights = sum(p.numel() for p in stack[0].parameters() if p.dim() == 2)
    return weights, extra[rounds // 2] / (blocks * (micro - 1))


def split_rates() -> tuple[float, float]:
    """(seconds per block per micro-batch, seconds per activation element per block) that torch's
    split backward (the zero-bubble schedules' input and weight halves) costs beyond one full
    backward: `measure_split` on SPLIT_STAGES, each extra = fixed + tokens x width x per_element, two
    equations in two unknowns. A noisy pair that gives a negative part keeps the other alone."""
    (n1, e1), (n2, e2) = ((b * s * w, measure_split(w, s, b)) for w, s, b in SPLIT_STAGES)
    per_element = (e2 - e1) / (n2 - n1)
    if per_element <= 0:
        return max(0.0, (e1 + e2) / 2), 0.0
    fixed = e1 - n1 * per_element
    return (fixed, per_element) if fixed > 0 else (0.0, e2 / n2)


def measure_split(width: int, positions: int, sequences: int, rounds: int = 9) -> float:
    """Seconds per block per micro-batch that torch's split backward costs beyond a full one, as its
    zero-bubble schedules run it: ScheduleZBVZeroBubble against ScheduleInterleaved1F1B on two
    stages of SPLIT_BLOCKS blocks each, both on this process (a one-rank fake process group: no
    message leaves it), SPLIT_MICROBATCHES micro-batches of `sequences`. Only the second stage
    splits (torch runs the first stage's backward whole), so the difference of the two steps is
    its extra; the median over interleaved rounds (never below 0). Timed through the schedules,
    not by calling torch's stage_backward_input and stage_backward_weight back to back: in the
    schedule the weight half runs after other actions, and costs more (0.69 against 0.54 ms a
    block at 64 wide x 4 x 64 tokens, 2026-11-29)."""
    if dist.is_initialized():
        raise RuntimeError("measure_split makes its own one-rank process group: call it where none exists")
    cfg = GPTConfig(block_size=positions, n_embd=width, n_head=4, dropout=0.0)
    m = SPLIT_MICROBATCHES
    x, target = torch.randn(sequences * m, positions, width), torch.randn(sequences * m, positions, width)
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        def schedule(cls):
            stages = [PipelineStage(torch.nn.Sequential(*[Block(cfg) for _ in range(SPLIT_BLOCKS)]), i, 2,
                                    torch.device("cpu"), group=dist.group.WORLD) for i in range(2)]
            return cls(stages, m, loss_fn=lambda out, y: (out * y).mean())
        split, whole = schedule(ScheduleZBVZeroBubble), schedule(ScheduleInterleaved1F1B)
        for _ in range(2):  # warm-up (the first step infers the stages' shapes)
            split.step(x, target=target), whole.step(x, target=target)
        extra = sorted(timed(lambda: split.step(x, target=target)) - timed(lambda: whole.step(x, target=target))
                       for _ in range(rounds))
    finally:
        dist.destroy_process_group()
    return max(0.0, extra[rounds // 2] / (m * SPLIT_BLOCKS))


def measure_memory_bandwidth(elems: int = 16 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of the best copy (read + write) of a 64 MB fp32 tensor."""
    a = torch.ones(elems)
    b = torch.empty_like(a)
    best = min(timed(lambda: b.copy_(a)) for _ in range(repeats))
    return 2 * a.numel() * a.element_size() / best


def measure_block(width: int, positions: int, sequences: int, repeats: int) -> float:
    """The best seconds of forward + backward of one GPT block (fp32, no dropout)."""
    block = Block(GPTConfig(block_size=positions, n_embd=width, n_head=4, dropout=0.0))
    x = torch.randn(sequences, positions, width, requires_grad=True)

    def step():
        block(x).sum().backward()
    step()
    return min(timed(step) for _ in range(repeats))


def collective_call(kind: str, x: torch.Tensor, out: torch.Tensor) -> None:
    """One gloo call of `kind` on x at 2 ranks, as the engines issue it: "all-reduce" (DDP),
    "all-gather" of x's first half into out[:x.numel()] (FSDP2, ZeRO), "all-to-all" of x into
    out[:x.numel()] (the project's reduce-scatter on gloo, parallel/collectives.py)."""
    if kind == "all-reduce":
        dist.all_reduce(x)
    elif kind == "all-gather":
        dist.all_gather_into_tensor(out[: x.numel()], x[: x.numel() // 2])
    else:
        dist.all_to_all_single(out[: x.numel()], x)


def measure_link_and_engines(timeout_s: float = 180) -> dict:
    """The figures 2 local processes measure (`_link_child`): the busy-node slowdown, the latency per
    ring step (after ~6 ms of compute, and right after the previous call) and bandwidth of gloo's
    all-reduce, all-gather and all-to-all, the compute gap; then, in the first of them (its gloo group closed,
    its peer gone), the engines' figures on the fake process group (tools/calibrate_engines.py) with this
    process's thread count. One launch: a process's imports cost seconds."""
    with tempfile.TemporaryDirectory() as tmp, multiprocess_lock():
        procs = [subprocess.Popen([sys.executable, "-m", "tools.calibrate", str(r), str(Path(tmp) / "store"),
                                   str(torch.get_num_threads())],
                                  env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the calibration failed: {outs[0][1].strip()[-300:] or outs[1][1].strip()[-300:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def busy_node_slowdown(rank: int, repeats: int = 7) -> float:
    """The median forward + backward of a 128-wide GPT block (8 x 64 tokens, ~20 ms) while the
    other process computes the same, over the median while it waits in a barrier (>= 1)."""
    block = Block(GPTConfig(block_size=64, n_embd=128, n_head=4, dropout=0.0))
    x = torch.randn(8, 64, 128, requires_grad=True)

    def median_step() -> float:
        block(x).sum().backward()
        return sorted(timed(lambda: block(x).sum().backward()) for _ in range(repeats))[repeats // 2]
    alone = median_step() if rank == 0 else 0.0
    dist.barrier()
    both = median_step()
    dist.barrier()
    return max(1.0, both / alone) if rank == 0 else 1.0


class LinkTimer:
    """The link's calls as a step issues them: each after GAP_MATMULS matmuls of ~6 ms on both
    ranks (`work`), or right after the previous call."""

    def __init__(self):
        self.a = torch.randn(256, 256)

    def work(self) -> None:
        for _ in range(GAP_MATMULS):
            self.a @ self.a

    def mean(self, call, calls: int, gap: bool = True) -> float:
        """The mean seconds of `calls` calls, each after `work` (gap) or right after the last."""
        for _ in range(3):
            call()
        total = 0.0
        for _ in range(calls):
            if gap:
                self.work()
            total += timed(call)
        return total / calls

    def rates(self) -> dict[str, tuple[float, float, float]]:
        """Per kind: (seconds per ring step after `work`, bytes/s one rank sends, seconds per ring step
        right after the previous call) at 2 ranks. The calls' times are heavy-tailed (_link_child),
        so their mean needs many: 160 small calls a kind after `work`, 160 right after another and
        40 large, in LINK_ROUNDS rounds with the kinds taking turns, so that a slow minute of the
        machine weighs on all three alike (40 and 20 calls, one kind after the other, gave a gather
        latency of 1.5-2.6 ms in three calibrations two minutes apart)."""
        small, large = torch.ones(SMALL), torch.ones(LARGE)
        out = torch.empty(LARGE)
        sums = {kind: [0.0, 0.0, 0.0] for kind in LINK_KINDS}
        for _ in range(LINK_ROUNDS):
            for kind in LINK_KINDS:
                sums[kind][0] += self.mean(lambda: collective_call(kind, small, out), 40) / LINK_ROUNDS
                sums[kind][1] += self.mean(lambda: collective_call(kind, large, out), 10) / LINK_ROUNDS
                sums[kind][2] += self.mean(lambda: collective_call(kind, small, out), 40, gap=False) / LINK_ROUNDS
        got = {}
        for kind, (small_s, large_s, near_s) in sums.items():
            steps, sent = (2, 1.0) if kind == "all-reduce" else (1, 0.5)
            latency = small_s / steps
            # at least half the call is the bytes' time: a noisy latency cannot turn into an absurd bandwidth
            bandwidth = sent * large.numel() * large.element_size() / max(large_s - steps * latency, large_s / 2)
            # a call right after another never costs more than one after the gap: a noisy mean of
            # the near calls is held to the far one
            got[kind] = latency, bandwidth, min(near_s / steps, latency)
        return got


def _link_child(rank: int, store_path: str, threads: int) -> None:
    """One of the 2 calibration processes. A step issues each collective after a stretch of compute,
    and its time sums many of them: so each call here follows the same ~6 ms of matmuls on both
    ranks, and the mean counts (on the 2-core machine the calls are bimodal, 0.3-0.5 ms or about
    3 ms while the peer's communication threads wake up). Latency per ring step: the mean 4 KB
    all-reduce / 2 (2 ring steps on 2 ranks); bandwidth: each rank sends K of an 8 MB one,
    K / (mean - 2 latency). The same for gloo's all-gather and all-to-all (FSDP2's and ZeRO's
    gathers; the project's reduce-scatter on gloo, parallel/collectives.py), 1 ring step each at 2
    ranks, each rank sending K/2: gloo's are not a ring's pieces of its all-reduce (measured by
    benchmarks/collective_rates.py: a 4 KB all-gather 2.4 ms where the all-reduce's ring step is
    0.9 ms), so they get their own figures. Each kind's small call is timed a third way, right after
    the previous call with no compute between (its near latency): a call's cost grows with the
    compute since the rank's last one (planner/timing.py step_latency), and tensor parallelism's or
    a pipeline's calls follow a fraction of a ms of it, not 7; `latency_gap` is the median time of
    the compute before each far call."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    slowdown = busy_node_slowdown(rank)
    timer = LinkTimer()
    got = timer.rates()
    gap = sorted(timed(timer.work) for _ in range(5))[2]
    (latency, bandwidth, near), gather, scatter = got["all-reduce"], got["all-gather"], got["all-to-all"]
    torch.set_num_threads(threads)  # the threads engines() times the same model with on the fake group
    # FSDP2's state holds gloo's work and its tensors: released (fsdp_steps keeps no model) while the
    # interpreter is alive, else a process sometimes aborted at exit ("terminate called without an
    # active exception": 2 in about 30 calibrations here; https://github.com/pytorch/pytorch/pull/179291)
    gloo_fsdp = fsdp_steps((ENGINE_MODEL, FSDP_BYTES_MODEL), init_device_mesh("cpu", (2,)))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        figures = engines(threads)
        call, byte = fsdp_call_costs(*zip(gloo_fsdp, figures.pop("fsdp_steps")), slowdown, gather[1], scatter[1])
        print(json.dumps({"latency": latency, "bandwidth": bandwidth, "near_latency": near, "latency_gap": gap,
                          "busy_node_slowdown": slowdown,
                          "gather_latency": gather[0], "gather_bandwidth": gather[1], "near_gather_latency": gather[2],
                          "scatter_latency": scatter[0], "scatter_bandwidth": scatter[1], "near_scatter_latency": scatter[2],
                          "fsdp_call_latency": call, "fsdp_byte_time": byte, **figures}), flush=True)


if __name__ == "__main__":
    _link_child(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
