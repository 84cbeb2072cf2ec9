"""The CUDA and NCCL paths a reading of the code found broken, each shown on this CPU machine where a
CPU can cause the fault (a meta tensor standing in for a second device, torch's CUDA calls recorded,
NCCL's recorder functions given to the CPU build); scripts/gpu_check.sh runs them on a GPU
(docs/gpu-check.md)."""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import guards.watchdog as watchdog
import parallel.env
from checks import load_config
from guards.health import _NEVER, FiniteCheck
from observe.step_metrics import CudaPeaks
from parallel.env import DistEnv, deterministic_mode
from parallel.fsdp import FSDPStrategy
from parallel.layout import Layout
from parallel.parallelize import parallelize
from parallel.strategy import Strategy
from planner.auto import hardware_file_of
from testing.local import REPO, child_env, torchrun


class _OnDevice(Strategy):
    """A strategy whose training device is `device`, holding `module` (what FiniteCheck reads)."""

    def __init__(self, device: str, module: nn.Module):
        super().__init__(load_config(None, []), DistEnv(device=torch.device(device)))
        self.module = module

    def unwrapped(self):
        return [self.module]


def test_the_finite_check_takes_parameters_kept_on_another_device_than_the_loss():
    """FSDP's CPU offload keeps the parameters in host memory while the loss lives on the GPU: the
    parameter verdict must move to the loss's device before the two are stacked (before: "Expected
    all tensors to be on the same device" before every snapshot). 'meta' stands in for the GPU."""
    check = FiniteCheck(_OnDevice("meta", nn.Linear(4, 4)))  # the loss's flag on 'meta', the weights on the CPU
    flags = check.flags(step=7, params=True)
    assert flags.device.type == "meta" and flags.shape == (2,)
    healthy = FiniteCheck(_OnDevice("cpu", nn.Linear(4, 4)))
    assert healthy.flags(step=7, params=True).tolist() == [_NEVER, _NEVER]
    sick = nn.Linear(4, 4)
    with torch.no_grad():
        sick.weight[0, 0] = float("nan")
    assert FiniteCheck(_OnDevice("cpu", sick)).flags(step=7, params=True).tolist() == [_NEVER, 7]


def test_the_watchdog_reads_and_dumps_ncclS_flight_recorder_beside_gloos(monkeypatch, tmp_path):
    """On a GPU the training's collectives are NCCL's, recorded by NCCL's own flight recorder
    (`_dump_nccl_trace*`, absent from CPU builds): the watchdog reads both recorders and dumps both."""
    c10d = torch._C._distributed_c10d
    nccl_entry = {"record_id": 3, "profiling_name": "nccl:all_reduce", "collective_seq_id": 9, "retired": False,
                  "process_group": ["0", "default_pg"], "is_p2p": False}
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *a: json.dumps({"entries": [nccl_entry]}), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *a: b"nccl-pickle", raising=False)
    names = [e["profiling_name"] for e in watchdog.flight_records()]
    assert "nccl:all_reduce" in names
    assert watchdog.collective_state(watchdog.flight_records())[0] == "all_reduce #9 on default_pg"
    dog = watchdog.HangWatchdog(3, 0, 1, 0, False, tmp_path)
    dog._write_dumps(tmp_path / "dumps")
    assert (tmp_path / "dumps" / "nccl_trace_rank_0").read_bytes() == b"nccl-pickle"
    assert (tmp_path / "dumps" / "stacks_rank_0.txt").is_file()


def test_the_watchdog_fires_before_the_process_group_times_out(monkeypatch):
    """On NCCL a collective that outlives the process-group timeout aborts every rank with no line:
    the watchdog's budget (4 x hang_timeout_s for start-up, saves, evaluation) must end before it.
    Before, 4 x 300 s = 1,200 s against a 600 s timeout."""
    monkeypatch.setattr(parallel.env, "_PG_TIMEOUT", datetime.timedelta(seconds=600))
    dog = watchdog.HangWatchdog(300, 1, 2, 0, True, REPO)
    assert dog.budget(watchdog.Beat(0, "start-up", 0.0)) == 480 < 600
    assert dog.budget(watchdog.Beat(5, "train", 0.0)) == 300
    alone = watchdog.HangWatchdog(300, 0, 1, 0, False, REPO)  # one process: no group to time out
    assert alone.budget(watchdog.Beat(0, "start-up", 0.0)) == 1200


def _group_timeouts(rank: int, path: str, out: str) -> None:
    os.environ.update(MINGPT_PG_TIMEOUT="42")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=42))
    parallel.env._PG_TIMEOUT = datetime.timedelta(seconds=42)
    cfg = load_config(None, ["parallel.strategy=fsdp", "parallel.dp_replicate=2", "trainer.batch_size=4"])
    mesh = Layout.of(cfg, 2).build_mesh("cpu", True)  # HSDP: dp_replicate x dp_shard, flattened into dp

    def seconds(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    found = {name: seconds(mesh.get_group(name)) for name in ("pp", "dp_replicate", "dp_shard", "tp", "dp")}
    found["new_group"] = seconds(parallel.env.new_group(backend="gloo"))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


@pytest.mark.launch
def test_every_process_group_of_a_launch_has_its_timeout(tmp_path):
    """The default group gets MINGPT_PG_TIMEOUT; init_device_mesh's sub-groups and a plain new_group
    got torch's backend default (30 min on gloo), so a hang inside them outwaited the watchdog."""
    out = tmp_path / "timeouts.json"
    mp.spawn(_group_timeouts, args=(tempfile.mktemp(dir=tmp_path), str(out)), nprocs=2)
    assert json.loads(out.read_text()) == {k: 42.0 for k in ("pp", "dp_replicate", "dp_shard", "tp", "dp", "new_group")}


def test_a_gpu_mesh_gives_every_sub_group_gloo_beside_nccl(monkeypatch):
    """Left to itself, init_device_mesh on CUDA splits the default group's NCCL communicator
    (split_group), and the sub-groups have NCCL alone: CPU tensors (FSDP2's CPU-offloaded gradients
    in the norm over dp) cannot cross them. torch's calls recorded, nothing started."""
    import parallel.layout
    asked = []

    class Mesh:
        def __getitem__(self, names):
            return self

        def _flatten(self, name, backend_override=None):
            asked.append((name, backend_override))

    monkeypatch.setattr(parallel.layout, "init_device_mesh",
                        lambda device, shape, mesh_dim_names, backend_override: asked.append(backend_override) or Mesh())
    monkeypatch.setattr(parallel.layout, "time_out_mesh", lambda mesh: None)
    cfg = load_config(None, ["parallel.strategy=fsdp", "parallel.dp_replicate=2", "trainer.batch_size=4"])
    Layout.of(cfg, 4).build_mesh("cuda", True)
    assert asked == [{name: "cpu:gloo,cuda:nccl" for name in ("pp", "dp_replicate", "dp_shard", "tp")},
                     ("dp", "cpu:gloo,cuda:nccl")]
    asked.clear()
    Layout.of(cfg, 4).build_mesh("cpu", True)  # CPU runs: gloo alone, as before
    assert asked == [None, ("dp", None)]


class _FakeEvent:
    """A CUDA event on the CPU: each pair spans 2.5 ms."""

    def record(self):
        pass

    def elapsed_time(self, end) -> float:
        return 2.5


def test_on_a_gpu_the_straggler_figure_is_the_blocks_forward_gpu_time():
    """On a GPU the training thread's clock counts kernel launches and waiting, the same on every
    rank: the figure is the GPU time of each block's forward (an event pair per block, from module
    hooks), per step, spread over ranks as on the CPU."""
    from guards.stragglers import GpuBlockClock, StragglerWatch
    from model import GPT, GPTConfig
    gpt = GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=3, n_head=2, n_embd=16))
    clock = GpuBlockClock(list(gpt.blocks.values()), event=_FakeEvent)
    watch = StragglerWatch(0, 1, 0, False, announce=False, gpu_clock=clock)
    for _ in range(2):  # two steps, each one forward of 3 blocks
        with watch.timed():
            gpt(torch.randint(0, 65, (2, 8)))
    assert watch.row(step=2)["compute_ms_median"] == 3 * 2.5  # per step
    assert clock.read_ms() == 0.0  # read and cleared on the log step


def test_mfu_divides_by_the_peak_of_the_dtype_fsdp_computes_in():
    """parallel.mixed_precision=bf16 under trainer.precision=fp32: FSDP casts the parameters, the
    matmuls run in bf16, so MFU's peak is bf16's (before: fp32's, MFU about 2x too high on a GPU)."""
    cfg = load_config(None, ["parallel.strategy=fsdp", "parallel.mixed_precision=bf16"])
    two = FSDPStrategy(cfg, DistEnv(rank=0, world_size=2), Layout.of(cfg, 2))
    assert two.compute_precision == "bf16"
    one = FSDPStrategy(cfg, DistEnv(), Layout.of(cfg, 1))  # one process: nothing wrapped, nothing cast
    assert one.compute_precision == "fp32"
    assert Strategy(load_config(None, ["trainer.precision=fp16"]), DistEnv()).compute_precision == "fp16"


@pytest.mark.parametrize("gpu, spec", [("NVIDIA H200", "h200-sxm"), ("NVIDIA GH200 480GB", "h200-sxm"),
                                       ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                                       ("NVIDIA L4", None)])
def test_auto_plans_a_gpu_with_its_own_hardware_file(gpu, spec):
    """Before, every GPU that was not an H100 was planned as an A100 (an H200 too)."""
    assert hardware_file_of(gpu) == spec


def test_the_cuda_peak_is_the_log_windows_not_the_set_ups(monkeypatch):
    """torch's max_memory_allocated holds the peak since the process started: each row's figure is
    read and the counter reset, so a later window's smaller peak shows; the run's peak is kept apart."""
    allocated = iter([900, 300, 500])  # set-up's peak, then two windows
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    peaks = CudaPeaks()
    assert [peaks.window(torch.device("cuda", 0)) for _ in range(3)] == [(900, 900), (300, 900), (500, 900)]
    assert len(resets) == 3


def test_deterministic_mode_asks_torch_for_deterministic_kernels(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        deterministic_mode(False)
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        deterministic_mode(True)
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before)


def test_compile_takes_each_block_before_the_data_parallel_engine(monkeypatch):
    """torchtitan's order: each block compiled in place, then the engine wraps the model, so its
    hooks (FSDP2's gathers, DDP's buckets) stay outside the graphs and the embeddings and the loss stay
    eager (inductor's embedding backward adds with atomics: tp peers' replicated gradients could
    differ). Nothing is compiled until a forward runs, so this is cheap."""
    from model import GPT, GPTConfig
    cfg = load_config(None, ["trainer.compile=true", "parallel.strategy=none"])
    gpt = GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=2, n_head=2, n_embd=16))
    seen = []

    def engine(module):
        seen.append([block._compiled_call_impl is not None for block in module.blocks.values()])
        return module
    runner = parallelize(gpt, cfg, Layout.of(cfg, 1), None, DistEnv(), engine)
    assert seen == [[True, True]]  # compiled before the engine saw them
    assert runner.model is gpt and gpt._compiled_call_impl is None  # the whole model is not compiled


def test_nn_dataparallel_with_compile_compiles_the_wrapper_not_the_blocks(monkeypatch):
    """nn.DataParallel's replicas copy each block's __dict__, so a block compiled in place would run
    GPU 0's weights on GPU 1: under dp the blocks run eager and the whole wrapper is compiled."""
    from model import GPT, GPTConfig
    from parallel.dp import DataParallelStrategy
    cfg = load_config(None, ["trainer.compile=true", "parallel.strategy=dp"])
    strategy = DataParallelStrategy(cfg, DistEnv())
    monkeypatch.setattr(DataParallelStrategy, "gpu_ids", property(lambda self: [0, 1]))
    monkeypatch.setattr(nn, "DataParallel", lambda module, device_ids, output_device: module)
    gpt = GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=2, n_head=2, n_embd=16))
    for block in gpt.blocks.values():
        block.compile()
    wrapped = strategy.wrap_data_parallel(gpt)
    assert all(block._compiled_call_impl is None for block in gpt.blocks.values())
    assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule)


@pytest.mark.launch
def test_the_gpu_check_on_a_machine_without_a_gpu_is_one_line_and_exit_2():
    # no GPU visible, in a cuda session on a GPU machine too (there it would run the whole check)
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=child_env(CUDA_VISIBLE_DEVICES=""),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout.splitlines() == [f"gpu_check: torch {torch.__version__} sees no CUDA device; run it on a "
                                     f"machine with an NVIDIA GPU"] and not r.stderr.strip(), (r.stdout, r.stderr)


@pytest.mark.launch
def test_the_gpu_checks_cp_probe_runs_the_gpus_kernels_within_its_bounds_here():
    """testing/cp_probe.py, which the GPU check runs on 2 and 4 ranks sharing a GPU, here on 2 CPU
    ranks with the GPU's plain-matmul block kernels: fp32 and bf16 autocast within its bounds (the
    bf16 backward of those kernels raised a dtype error before an H200 ran it)."""
    r = torchrun(2, ["-m", "testing.cp_probe", "--math-kernels"], timeout=120, CUDA_VISIBLE_DEVICES="")  # on the CPU
    assert r.returncode == 0, r.stderr[-3000:]
    probe = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("cp-probe: "))[10:])
    assert probe["within_bounds"] and "math_block on cpu" in probe["summary"], probe
    assert probe["figures"]["ring fp32"][1] < 1e-5 and probe["figures"]["allgather bf16"][1] > 1e-4, probe


@pytest.mark.launch
def test_every_selection_the_multi_gpu_check_runs_collects_tests(monkeypatch):
    """scripts/gpu_check.sh runs these pytest selections on CUDA with 2+ GPUs; a selection that
    matches no test would pass there while proving nothing (as `-k "dataparallel or nn_dp"` did)."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    for name, args in gpu_check.MULTI_GPU_TESTS.items():
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                           cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
        collected = [line for line in r.stdout.splitlines() if "::" in line]
        assert r.returncode == 0 and collected, (name, r.stdout[-2000:], r.stderr[-2000:])


def test_a_bad_deterministic_value_is_one_line_and_exit_2(tmp_path, capsys):
    import main
    assert main.main([f"trainer.run_dir={tmp_path / 'run'}", "trainer.deterministic=maybe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.deterministic" in err[0], err
    assert not (tmp_path / "run").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_a_gpu_clock_that_times_no_block_leaves_the_figure_out():
    """A model compiled as one graph (trainer.compile_scope=model) or nn.DataParallel's compiled
    wrapper is not hooked per block (the hooks would break the graph): one process, whose row then
    has no compute_ms_* (a 0 would read as a measurement)."""
    from guards.stragglers import GpuBlockClock, StragglerWatch
    watch = StragglerWatch(0, 1, 0, False, announce=False, gpu_clock=GpuBlockClock([], event=_FakeEvent))
    with watch.timed():
        pass
    assert watch.row(step=1) == {}
