"""The figures of the metrics row: what memory is reported and under which name, the
device count and the peak that MFU divides by, and the fp32 matmul mode the GPU peak assumes.

- Memory: on CPU the process's peak RSS (interpreter, libraries, allocator caches included: not
  comparable across strategies) is `rss_peak_mb`; `held_params_mb`, `held_grads_mb` and
  `held_optim_mb` are the tensor bytes the strategy itself holds (Strategy.resident_bytes), read
  on log steps only, after the optimizer step and before the gradients are freed.
- MFU divides by every device of the layout: under parallel.strategy=dp (nn.DataParallel) one
  process drives all GPUs.
- bf16 on CPU: the peak is a bf16 matmul, measured the same way as the fp32 one.
- MFU is never above 1: a CPU peak is cached per machine fingerprint in a JSON file
  ($MINGPT_PEAK_CACHE here: a file of each test's own, empty for the tests about the peak, holding
  a fixed fp32 peak for the others, which never measure it); a cached peak that a run exceeds (a
  stale cache, caused by seeding the file with a peak that is too low) is measured again; a trainer.peak_flops
  that a run exceeds is never re-measured but flagged, and MFU is 0 (unknown) from then on; a damaged
  cache file is ignored (measured again and rewritten), with no traceback.
- CUDA (no GPU here: only the table lookup and the switch are tested): fp32 matmuls run as TF32
  on GPUs that have it, and the peak and its label say TF32 there and fp32 elsewhere.
"""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from checks import load_config
from launch.build import build_trainer
from observe import perf
from observe.tracker import NullTracker
from parallel import env
from parallel.dp import DataParallelStrategy
from parallel.env import DistEnv, init_distributed
from parallel.strategy import Strategy
from testing.local import TINY

SEEDED_PEAK = 1e15  # FLOP/s: above any CPU's fp32 peak, so no run exceeds it (which would measure again)


@pytest.fixture(autouse=True)
def _own_peak_cache(request, tmp_path, monkeypatch):
    """Every test here has its own CPU peak cache file. The tests about the peak ask for
    `peak_cache`: theirs starts empty. Any other finds a fixed fp32 peak in it and must not measure
    (a measurement is about a second of matmuls, and not what it tests)."""
    path = tmp_path / "cache" / "peak-flops.json"
    monkeypatch.setenv("MINGPT_PEAK_CACHE", str(path))
    if "peak_cache" not in request.fixturenames:
        path.parent.mkdir()
        path.write_text(json.dumps({perf.machine_fingerprint("fp32"): SEEDED_PEAK}))

        def refused(*args, **kwargs):
            pytest.fail("a test not about the CPU peak measured it: its cache holds SEEDED_PEAK for fp32 "
                        "(another precision or thread count needs its own entry), or it asks for peak_cache")
        monkeypatch.setattr(perf, "measure_cpu_peak", refused)
    return path


@pytest.fixture
def peak_cache(_own_peak_cache):
    """This test's CPU peak cache file, empty: for the tests about the peak."""
    return _own_peak_cache


def tiny_trainer(run_dir, *overrides):
    cfg = load_config(None, TINY + ["parallel.strategy=none", "trainer.eval_every=100",
                                    f"trainer.run_dir={run_dir}", *overrides])
    return build_trainer(cfg, init_distributed(cfg), run_dir)


class Rows(NullTracker):
    def __init__(self):
        self.rows = []

    def log(self, step, metrics):
        self.rows.append({"step": step, **metrics})


def test_memory_metrics_name_rss_and_hold_the_strategy_tensor_bytes(tmp_path, monkeypatch):
    cfg = load_config(None, TINY + ["parallel.strategy=none", "trainer.max_steps=4", "trainer.log_every=2",
                                    "trainer.eval_every=100", f"trainer.run_dir={tmp_path}"])
    trainer = build_trainer(cfg, init_distributed(cfg), tmp_path)
    s = trainer.strategy
    measured = []
    real = s.resident_bytes

    def spy(optimizer):
        measured.append(real(optimizer))
        return measured[-1]

    monkeypatch.setattr(s, "resident_bytes", spy)
    trainer.tracker = Rows()
    trainer.train()
    rows = [r for r in trainer.tracker.rows if "loss" in r]
    assert [r["step"] for r in rows] == [2, 4] and len(measured) == 2  # read on log steps only
    for row, held in zip(rows, measured):
        assert "peak_mem_mb" not in row and row["rss_peak_mb"] > 0
        # MB = 10^6 bytes, the planner's unit (--plan, the strategy report): figures compare as they are
        assert row["held_params_mb"] == held["params"] / 1e6
        assert row["held_grads_mb"] == held["grads"] / 1e6
        assert row["held_optim_mb"] == held["optimizer"] / 1e6
        # one process, fp32: a gradient per parameter, and AdamW's two moments per parameter
        assert held["grads"] == held["params"] > 0 and held["optimizer"] == 2 * held["params"]


def test_bf16_mfu_on_cpu_divides_by_a_bf16_peak(tmp_path, peak_cache):
    peaks = {}
    for prec in ("fp32", "bf16"):
        trainer = tiny_trainer(tmp_path / prec, f"trainer.precision={prec}", "trainer.device=cpu")  # a CPU peak: in a cuda session too
        peaks[prec] = trainer.peak.value
        assert prec in trainer.parts.peak_label and "measured" in trainer.parts.peak_label, trainer.parts.peak_label
    # each is cached under its own fingerprint (CPU model, threads, torch version, dtype)
    cached = json.loads(peak_cache.read_text())
    assert cached == {perf.machine_fingerprint(p): peaks[p] for p in peaks}
    assert peaks["bf16"] != peaks["fp32"]


def test_a_stale_cached_cpu_peak_is_measured_again_and_mfu_never_exceeds_1(tmp_path, peak_cache, capsys):
    key = perf.machine_fingerprint("fp32")
    peak_cache.parent.mkdir()
    peak_cache.write_text(json.dumps({key: 1e3, "another machine": 5e9}))  # far below any real CPU
    trainer = tiny_trainer(tmp_path, "trainer.max_steps=4", "trainer.log_every=2", "trainer.device=cpu")
    assert "cached" in trainer.parts.peak_label and "1e-06 GFLOP/s" in trainer.parts.peak_label, trainer.parts.peak_label
    trainer.tracker = Rows()
    trainer.train()
    mfus = [r["mfu"] for r in trainer.tracker.rows if "mfu" in r]
    assert len(mfus) == 2 and all(0 < m <= 1 for m in mfus), mfus
    remeasured = json.loads(peak_cache.read_text())
    assert remeasured[key] > 1e6 and remeasured["another machine"] == 5e9
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and str(peak_cache) in warnings[0] and "measured again" in warnings[0], warnings


def test_a_peak_flops_override_that_a_run_exceeds_is_flagged_never_remeasured(tmp_path, peak_cache, capsys):
    trainer = tiny_trainer(tmp_path, "trainer.max_steps=4", "trainer.log_every=2", "trainer.peak_flops=1000")
    trainer.tracker = Rows()
    trainer.train()
    assert [r["mfu"] for r in trainer.tracker.rows if "mfu" in r] == [0.0, 0.0]  # unknown, not 1e5 %
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "trainer.peak_flops" in warnings[0], warnings
    assert not peak_cache.exists()  # nothing measured (a measurement is written to the cache)


def test_only_the_reporting_rank_measures_the_cpu_peak(peak_cache, monkeypatch):
    """Every rank builds a Peak; a cold cache must be measured once (by the tracker rank), not by
    every rank at once on the same cores, which would also measure a peak too low."""
    calls = []
    monkeypatch.setattr(perf, "measure_cpu_peak", lambda precision: calls.append(precision) or 5e9)
    other = perf.Peak(torch.device("cpu"), "fp32", report=False)
    assert (other.value, other.label, calls) == (0.0, "", [])
    assert other.mfu(1e6, 1e6, 1) == 0.0 and calls == []  # no peak, no MFU, never a re-measure
    tracker = perf.Peak(torch.device("cpu"), "fp32", report=True)
    assert tracker.value == 5e9 and calls == ["fp32"] and "measured" in tracker.label


def test_a_damaged_peak_cache_is_measured_again_and_rewritten(tmp_path, peak_cache, capsys):
    peak_cache.parent.mkdir()
    peak_cache.write_bytes(b"\x00\xff{not json")
    t0 = time.perf_counter()
    measured = tiny_trainer(tmp_path / "a", "trainer.device=cpu").parts.peak_label
    t1 = time.perf_counter()
    cached = tiny_trainer(tmp_path / "b", "trainer.device=cpu").parts.peak_label
    t2 = time.perf_counter()
    assert "measured" in measured and "cached" in cached and measured.split("(")[0] == cached.split("(")[0]
    assert list(json.loads(peak_cache.read_text())) == [perf.machine_fingerprint("fp32")]
    assert "Traceback" not in capsys.readouterr().err
    print(f"start-up: {t1 - t0:.2f} s measuring the peak, {t2 - t1:.2f} s with it cached")


def test_mfu_counts_every_device_the_layout_uses(monkeypatch):
    cfg = load_config(None, ["parallel.strategy=dp"])
    gpu = DistEnv(device=torch.device("cuda", 0))
    for visible, expected in ((4, 4), (1, 1)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=visible: n)
        assert DataParallelStrategy(cfg, gpu).num_devices == expected
    assert DataParallelStrategy(cfg, DistEnv()).num_devices == 1  # on CPU nn.DataParallel is not used
    ddp = load_config(None, ["parallel.strategy=ddp", "trainer.batch_size=8"])
    assert Strategy(ddp, DistEnv(world_size=4, device=torch.device("cuda", 0))).num_devices == 4  # a GPU per process
    # on CPU, the process peaks the cores really give (test_mfu_counts_the_cpu_peaks_the_cores_really_give)
    assert Strategy(ddp, DistEnv(world_size=4)).num_devices == env.cpu_devices(4, 4)[0]
    assert perf.mfu(1e6, 1e3, 1e9, 4) == pytest.approx(0.25)


@pytest.mark.parametrize("name, capability, precision, peak, label", [
    ("NVIDIA H100 80GB HBM3", (9, 0), "fp32", 494e12, "TF32"),
    ("NVIDIA H100 80GB HBM3", (9, 0), "bf16", 989e12, "bf16"),
    ("NVIDIA A100-SXM4-40GB", (8, 0), "fp32", 156e12, "TF32"),
    ("Tesla V100-SXM2-16GB", (7, 0), "fp32", 15.7e12, "fp32"),  # no TF32 before Ampere
])
def test_gpu_peak_and_label_agree_with_the_fp32_matmul_mode(monkeypatch, name, capability, precision,
                                                            peak, label):
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)  # a cuda session of the suite sets it
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    got, text = perf.device_peak(cuda, precision)
    assert got == peak and label in text and name in text, text


def test_fp32_matmuls_run_as_tf32_on_cuda_only(monkeypatch):
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)  # a cuda session of the suite sets it
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        perf.set_fp32_matmul_mode(torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32  # CPU numerics are never touched
        perf.set_fp32_matmul_mode(torch.device("cuda", 0))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_mfu_counts_the_cpu_peaks_the_cores_really_give(monkeypatch):
    """ddp with 4 one-thread processes on 2 cores: MFU divided by 4 one-thread peaks the machine
    does not have (0.167 against 0.497 with 2 processes). The devices are the cores' worth of
    process peaks, and the oversubscription is named; 2 processes on 2 cores are not flagged."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    devices, note = env.cpu_devices(world_size=4, local_world_size=4)
    assert devices == 2 and "4 processes x 1 thread(s) share 2 cores" in note, note
    assert env.cpu_devices(world_size=2, local_world_size=2) == (2, None)
    assert env.cpu_devices(world_size=8, local_world_size=4)[0] == 4  # two such nodes
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert env.cpu_devices(world_size=2, local_world_size=2)[0] == 1  # 2 x 2 threads on 2 cores


@pytest.mark.usefixtures("peak_cache")  # about the peak: measure_cpu_peak itself
@pytest.mark.parametrize("seconds_per_matmul, sizes", [(0.001, [256, 512, 1024] * 2), (0.2, [256, 256])])
def test_the_cpu_peak_sweep_skips_sizes_that_would_only_be_slow(seconds_per_matmul, sizes, monkeypatch):
    # a CPU emulating bf16 takes 0.2 s per 512^3 matmul and 2.6 s per 1024^3 one at the same rate:
    # once one matmul is slower than SLOW_MATMUL_S the sweep does not try 8x the work
    tried = []

    def fake(n, **kwargs):
        tried.append(n)
        return 2 * n ** 3 / seconds_per_matmul
    monkeypatch.setattr(perf, "measure_cpu_matmul_peak", fake)
    assert perf.measure_cpu_peak("bf16", rounds=2) == 2 * tried[-1] ** 3 / seconds_per_matmul
    assert tried == sizes


def test_the_peak_cache_key_names_the_cpus_instruction_sets(monkeypatch):
    """Two CPUs a virtual machine names alike ("AMD EPYC"), one with AVX-512 and one without, do
    not share a cached peak or the planner's local hardware figures (both keyed by it)."""
    monkeypatch.setattr(perf, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(perf, "cpu_flags", lambda: {"avx2", "fma"})
    older = perf.machine_fingerprint("fp32")
    monkeypatch.setattr(perf, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    newer = perf.machine_fingerprint("fp32")
    assert older != newer and "avx512_bf16" in newer and "avx512" not in older, (older, newer)
