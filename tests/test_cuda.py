"""Ready for the first GPU, checked on this CPU machine: the suite's device switch
(MINGPT_TEST_DEVICE: testing/local.py, tests/harness.py) and the CUDA-only branches that can be
exercised without a GPU (nn.DataParallel's replica threads, the GPU peak table, the TF32 switch)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import harness
import parallel.env
from checks import load_config
from config import UsageError
from model import GPT, GPTConfig
from observe import perf
from parallel.dp import DataParallelStrategy
from parallel.env import DistEnv, init_distributed
from parallel.step import autocast
from testing import local
from testing.local import REPO, TINY, child_env


@pytest.mark.launch
def test_cuda_switch_fails_the_session_with_one_line_on_a_machine_without_gpus():
    """The real suite's collection, asked to run on CUDA here: it must fail before any test runs,
    with one line naming the fix; never run on CPU instead, never skip."""
    env = child_env(MINGPT_TEST_DEVICE="cuda", CUDA_VISIBLE_DEVICES="")  # no GPU, in a cuda session too
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_config.py", "tests/test_cuda.py"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)  # pytest's usage error
    assert r.stderr.strip().splitlines() == [
        f"ERROR: MINGPT_TEST_DEVICE=cuda runs the suite on this machine's GPUs but torch {torch.__version__} sees "
        f"none: run it on a machine with a GPU, or unset MINGPT_TEST_DEVICE to run it on the CPU"], r.stderr
    assert "passed" not in r.stdout and "skipped" not in r.stdout + r.stderr, r.stdout


def test_the_switch_puts_every_run_and_process_on_the_device(monkeypatch):
    assert harness.device_problem("cpu") is None
    assert "MINGPT_TEST_DEVICE=gpu is not one of cpu, cuda" == harness.device_problem("gpu")
    assert local.device_overrides("cuda") == ["trainer.device=cuda"] and local.device_overrides("cpu") == []
    assert local.device_env("cuda") == {"NVIDIA_TF32_OVERRIDE": "0"}  # exact fp32 parity
    assert local.device_env("cpu") == {"CUDA_VISIBLE_DEVICES": ""}  # `auto` tests stay on the CPU
    # this session: TINY, this process and every child follow its switch
    assert all(child_env()[k] == v and os.environ[k] == v for k, v in local.device_env().items())
    assert [a for a in TINY if a.startswith("trainer.device=")] == local.device_overrides()
    # a cuda session on 4 GPUs: an 8-rank launch is refused before anything starts, as one the
    # session leaves out (conftest.py lists it); on one GPU the session still runs (no refusal)
    monkeypatch.setattr(local, "DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(local.NotEnoughGPUs, match="8 ranks and NCCL needs one GPU per rank, but torch sees 4 GPUs"):
        local.torchrun(8, ["main.py"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert harness.device_problem("cuda") is None


def test_a_rank_binds_the_gpu_of_its_local_rank_and_serves_cpu_tensors_with_gloo(monkeypatch):
    """What init_distributed asks of torch on a GPU node (torch's calls recorded, nothing started):
    local rank 3 of a 4-process node on 4 GPUs drives GPU 3, NCCL is bound to it (device_id), and
    CPU tensors get a gloo backend in the same process group: FSDP2's CPU offload keeps sharded
    gradients on the CPU, and the gradient norm all-reduces them (pytorch#148532: a NCCL-only
    group fails with "No backend type associated with device type cpu")."""
    asked = _fake_gpu_node(monkeypatch, gpus=4, processes=4, rank=3)
    env = init_distributed(load_config(None, ["trainer.device=cuda"]))
    assert env.device == torch.device("cuda", 3) and asked["set_device"] == 3
    assert asked["device_id"] == torch.device("cuda", 3) and (asked["rank"], asked["world_size"]) == (3, 4)
    assert asked["backend"] == "cpu:gloo,cuda:nccl" and env.backend == "nccl"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # NCCL's own dump on a timeout goes into the run folder
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].endswith("shakespeare_char/nccl_trace_rank_")


def test_more_processes_than_gpus_is_one_line_on_every_rank_before_the_process_group(monkeypatch):
    """8 processes on a 4-GPU node: every rank (a low local rank too, which has a GPU) refuses with
    the same line before any process group starts; before, local rank 5 took GPU 1 beside rank 1 and
    NCCL failed later with a traceback."""
    for rank in (0, 5):
        asked = _fake_gpu_node(monkeypatch, gpus=4, processes=8, rank=rank)
        with pytest.raises(UsageError, match=r"^this node runs 8 processes but torch sees 4 GPUs, and NCCL needs "
                                             r"one GPU per process; launch torchrun --nproc_per_node=4"):
            init_distributed(load_config(None, ["trainer.device=cuda"]))
        assert "backend" not in asked and "set_device" not in asked


def _fake_gpu_node(monkeypatch, gpus: int, processes: int, rank: int) -> dict:
    """torch's CUDA and process-group calls recorded (nothing started) on a node of `gpus` GPUs that
    torchrun started `processes` ranks on; returns what was asked."""
    asked = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: asked.update(set_device=i))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked["set_device"])
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: asked.update(kw))
    monkeypatch.setattr(parallel.env, "_rendezvous_store", lambda rank, world, timeout: None)
    for k in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_BUFFER_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"RANK": str(rank), "WORLD_SIZE": str(processes), "LOCAL_RANK": str(rank),
                 "LOCAL_WORLD_SIZE": str(processes)}.items():
        monkeypatch.setenv(k, v)
    return asked


def test_dataparallel_replicas_compute_in_the_runs_autocast_dtype(monkeypatch):
    """nn.DataParallel runs each replica's forward in a thread of its own, inside
    `torch.amp.autocast(device_type, enabled=...)` without a dtype (torch/nn/parallel/parallel_apply.py),
    and autocast's dtype is thread-local: the thread gets the device's default dtype (fp16 on CUDA),
    not the run's. Reproduced here with the CPU's autocast (default bf16) and an fp16 run: the
    module that nn.DataParallel replicates must compute in fp16 in such a thread."""
    cfg = load_config(None, ["trainer.precision=fp16", "parallel.strategy=dp"])
    strategy = DataParallelStrategy(cfg, DistEnv())  # on the CPU: device cpu, the autocast we can run
    monkeypatch.setattr(DataParallelStrategy, "gpu_ids", property(lambda self: [0, 1]))
    wrapped = []  # nn.DataParallel as called (it cannot run on the CPU): the test sees what it replicates
    monkeypatch.setattr(nn, "DataParallel", lambda module, **kw: wrapped.append(kw) or module)
    gpt = GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=1, n_head=2, n_embd=16))
    replica = strategy.wrap_data_parallel(gpt)  # what nn.DataParallel would replicate
    assert wrapped == [{"device_ids": [0, 1], "output_device": 0}] and replica is not gpt
    x, dtypes = torch.randint(0, 65, (2, 8)), {}

    def replica_thread(enabled: bool):  # what parallel_apply's worker does
        with torch.amp.autocast("cpu", enabled=enabled):
            dtypes["logits"] = replica(x).dtype

    with autocast(cfg, torch.device("cpu")):
        t = threading.Thread(target=replica_thread, args=(torch.is_autocast_enabled("cpu"),))
        t.start()
        t.join()
    assert dtypes["logits"] == torch.float16


@pytest.mark.parametrize("name, capability, precision, peak", [
    ("NVIDIA H100 PCIe", (9, 0), "bf16", 756e12),
    ("NVIDIA H100 PCIe", (9, 0), "fp32", 378e12),
    ("NVIDIA H100 NVL", (9, 0), "bf16", 835e12),
    ("NVIDIA H200", (9, 0), "bf16", 989e12),
    ("NVIDIA H200 NVL", (9, 0), "fp32", 418e12),
    ("NVIDIA GH200 480GB", (9, 0), "bf16", 989e12),
    ("NVIDIA A100 80GB PCIe", (8, 0), "bf16", 312e12),
    ("NVIDIA L4", (8, 9), "bf16", 121e12),
    ("NVIDIA L40S", (8, 9), "bf16", 362e12),  # "L4" is in its name: not an L4
    ("NVIDIA L40", (8, 9), "fp32", 90.5e12),
    ("Tesla V100-PCIE-16GB", (7, 0), "fp16", 112e12),
    ("Tesla V100-SXM2-16GB", (7, 0), "bf16", 0.0),  # no bf16 tensor cores before Ampere
    ("NVIDIA B200", (10, 0), "bf16", 0.0),  # not in the table: unknown, MFU not reported
])
def test_gpu_peak_table_tells_variants_apart(monkeypatch, name, capability, precision, peak):
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    got, label = perf.device_peak(torch.device("cuda", 0), precision)
    assert got == peak and name in label, label
    if not peak:
        assert "MFU not reported" in label, label


def test_tf32_override_keeps_fp32_matmuls_in_full_precision(monkeypatch):
    """NVIDIA_TF32_OVERRIDE=0 (what the suite sets on CUDA): the app leaves torch's TF32 flags off,
    and the peak no longer claims TF32."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
        perf.set_fp32_matmul_mode(torch.device("cuda", 0))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        peak, label = perf.device_peak(torch.device("cuda", 0), "fp32")
        assert peak == 0.0 and "NVIDIA_TF32_OVERRIDE=0" in label, label
        assert perf.device_peak(torch.device("cuda", 0), "bf16")[0] == 989e12  # 16-bit: unaffected
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
