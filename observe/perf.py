"""Throughput accounting: the peak FLOP/s that MFU is measured against, and MFU itself.

MFU = achieved model FLOP/s / peak FLOP/s of the devices the layout uses, with model FLOPs from
`GPT.flops_per_token` (6N + 12LCT). On CUDA the peak comes from a table of dense bf16/fp16 and
fp32-matmul specs; fp32 matmuls run on TF32 tensor cores there (`set_fp32_matmul_mode`, as
nanoGPT and most training scripts do), so the fp32 peak is the TF32 one on GPUs that have TF32
(compute capability 8.0 and later) and the plain fp32 one before. On CPU there is no spec to
trust, so we measure it: the best of repeated matmuls of a few sizes in the training's own dtype
(fp32, or bf16/fp16 under autocast) on the threads this process is allowed to use. A neighbour's
work or a cold core only ever makes a measurement too low, so (1) the measurement is cached in a
small JSON file per machine fingerprint (CPU model, thread count, torch version, dtype), and start-up
reads it instead of measuring again; and (2) a run whose achieved FLOP rate exceeds the peak measures
again (once) and keeps the higher figure; if the rate still exceeds it (or exceeds a table or
trainer.peak_flops peak, never re-measured), a warning names the peak and MFU is reported as 0
(unknown peak) from then on: never above 100%. The benchmark prints its measured peak next to its MFU.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

from parallel.env import DTYPES
from parallel.precision import cpu_flags, fastest_cpu_precision
from storage.files import atomic_write_text

# Dense (no sparsity) peak FLOP/s per GPU from NVIDIA's datasheets: (bf16/fp16 tensor cores, fp32
# matmuls as run here: TF32 tensor cores where the GPU has them, else plain fp32). Matched against
# torch.cuda.get_device_name in this order, first match wins: a variant before its family ("H100
# PCIe" before "H100"), and whole words, so that "L4" is not "L40S".
_GPU_PEAKS: list[tuple[str, float, float]] = [
    (r"\bH100 PCIe\b", 756e12, 378e12),
    (r"\bH[12]00 NVL\b", 835e12, 418e12),
    (r"\bG?H[12]00\b", 989e12, 494e12),  # SXM (and GH200's Hopper GPU)
    (r"\bA100\b", 312e12, 156e12),  # SXM and PCIe alike
    (r"\bA10G\b", 125e12, 62.5e12),  # the A10 datasheet's dense figures (no separate A10G datasheet)
    (r"\bL40S\b", 362e12, 183e12),
    (r"\bL40\b", 181e12, 90.5e12),
    (r"\bL4\b", 121e12, 60e12),
    (r"\bV100-PCIE\b", 112e12, 14e12),  # no TF32 (compute capability 7.0): plain fp32
    (r"\bV100", 125e12, 15.7e12),  # SXM2
    (r"\b4090\b", 165e12, 82e12),
]
# NVIDIA's switch that keeps cuBLAS and cuDNN from using TF32 (set_fp32_matmul_mode honours it too).
TF32_OVERRIDE_ENV = "NVIDIA_TF32_OVERRIDE"

_cpu_peak_cache: dict[tuple[int, torch.dtype], float] = {}

# MINGPT_PEAK_CACHE relocates the cache file (the tests point it at a temporary folder).
PEAK_CACHE_ENV = "MINGPT_PEAK_CACHE"
# Matmul sizes of the CPU peak: small ones fit the caches, large ones amortize the threading; which
# size is fastest depends on the CPU. torch's CPU fp16 matmul is a slow generic kernel (0.4 GFLOP/s
# at 1024^3 on the project's machine): small sizes keep its measurement under a second.
_CPU_SIZES = {"fp16": (128, 256)}
_CPU_SIZES_DEFAULT = (256, 512, 1024)
SLOW_MATMUL_S = 0.05  # one matmul slower than this: the next size (8x the work) is not tried


def set_fp32_matmul_mode(device: torch.device) -> None:
    """fp32 matmuls and convolutions on CUDA run on TF32 tensor cores (10-bit mantissa inputs,
    fp32 accumulation): what users expect of a GPU training script, and what the peak table
    assumes. CPU numerics are left alone. (The legacy allow_tf32 switches: mixing them with the
    newer fp32_precision API makes torch.get_float32_matmul_precision raise, which inductor calls.)
    NVIDIA_TF32_OVERRIDE=0 in the environment (the test suite sets it for exact fp32 parity) leaves
    them off: that switch reaches only cuBLAS and cuDNN, and torch's flags also steer other kernels
    (inductor's generated matmuls)."""
    if device.type == "cuda" and not _tf32_disabled():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def _tf32_disabled() -> bool:
    return os.environ.get(TF32_OVERRIDE_ENV) == "0"


def measure_cpu_matmul_peak(n: int = 1024, repeats: int = 5, min_seconds: float = 0.0,
                            refresh: bool = False, dtype: torch.dtype = torch.float32) -> float:
    """Best observed FLOP/s of an n x n matmul in `dtype` on this process's threads (2 n^3
    FLOPs), over at least `repeats` runs and `min_seconds`. The best run, not the mean: on a shared
    machine a neighbour's work only ever slows a run down, so the fastest one is closest to the
    hardware. Cached per (thread count, dtype); `refresh` measures again (returning this
    measurement) and caches the higher of the two."""
    key = (torch.get_num_threads(), dtype)
    if key in _cpu_peak_cache and not refresh:
        return _cpu_peak_cache[key]
    g = torch.Generator().manual_seed(0)  # its own RNG: measuring must not shift training's stream
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    a @ b  # warm-up (thread pool, caches)
    best, runs, start = float("inf"), 0, time.perf_counter()
    while runs < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        runs += 1
    measured = 2 * n ** 3 / best
    _cpu_peak_cache[key] = max(measured, _cpu_peak_cache.get(key, 0.0))
    return measured


def peak_cache_path() -> Path:
    """The JSON file of measured CPU peaks: $MINGPT_PEAK_CACHE, else mingpt-parallel/peak-flops.json
    under $XDG_CACHE_HOME (default ~/.cache)."""
    if os.environ.get(PEAK_CACHE_ENV):
        return Path(os.environ[PEAK_CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mingpt-parallel" / "peak-flops.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


# The instruction sets a CPU's matmul speed depends on. A virtual machine often names only the
# vendor's family ("AMD EPYC"), which covers CPUs with and without AVX-512: the key names them too,
# so a cache filled on one never answers for another.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


# The flags a speed figure is printed beside (the benchmarks' CPU line): what decides the matmul rate
# and the fastest precision.
CPU_FLAGS_SHOWN = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_line() -> str:
    """The CPU and the flags that decide its fastest precision (parallel/precision.py), one line to
    print beside every speed figure: CPUs differ between machines."""
    flags = cpu_flags()
    shown = [f for f in CPU_FLAGS_SHOWN if f in flags]
    return (f"CPU: {cpu_model()} | flags {' '.join(shown) or '(none of ' + ' '.join(CPU_FLAGS_SHOWN) + ')'} | "
            f"fastest precision: {fastest_cpu_precision(flags)[1]}")


def machine_fingerprint(precision: str) -> str:
    """The cache key of a CPU peak (and of the local hardware figures): what they depend on."""
    isa = "+".join(f for f in ISA_FLAGS if f in cpu_flags()) or "no avx2"
    return f"{cpu_model()} | {isa} | {torch.get_num_threads()} threads | torch {torch.__version__} | {precision}"


def _read_peak_cache(path: Path) -> dict[str, float]:
    """The cached peaks; a missing, unreadable or damaged file (or entry) reads as none: it is only a
    cache, measured again and rewritten."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0}


def _write_peak_cache(path: Path, key: str, flops: float) -> None:
    """Store one peak, keeping the others; written to a temporary file and renamed, so a reader (or
    another rank writing at the same time) never sees half a file. A cache that cannot be written
    (read-only home) is skipped: the next start-up measures again."""
    peaks = _read_peak_cache(path)
    peaks[key] = flops
    with contextlib.suppress(OSError):  # e.g. a folder this user may not even look into
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(peaks, indent=1, sort_keys=True) + "\n")


def measure_cpu_peak(precision: str, rounds: int = 3, min_seconds: float = 0.1) -> float:
    """Best FLOP/s of `rounds` sweeps over a few matmul sizes, each size run for `min_seconds` (and at
    least 3 times): about a second in all. A sweep stops before the next (8x costlier) size once one
    matmul takes over SLOW_MATMUL_S: a CPU that emulates the dtype (bf16 without bf16 instructions:
    a 512^3 matmul takes 0.2 s, a 1024^3 one 2.6 s on the 2-core AVX2 machine, at the same rate)
    would spend 25 s on a sweep that measures nothing more."""
    dtype = DTYPES[precision]
    best = 0.0
    for _ in range(rounds):
        for n in _CPU_SIZES.get(precision, _CPU_SIZES_DEFAULT):
            rate = measure_cpu_matmul_peak(n=n, repeats=3, min_seconds=min_seconds, refresh=True, dtype=dtype)
            best = max(best, rate)
            if 2 * n ** 3 / rate > SLOW_MATMUL_S:
                break
    return best


def cpu_peak(precision: str, refresh: bool = False) -> tuple[float, bool]:
    """(the CPU peak FLOP/s of `precision` on this machine, whether it came from the cache file).
    `refresh` measures again and caches the higher of the cached and the new figure."""
    path, key = peak_cache_path(), machine_fingerprint(precision)
    cached = _read_peak_cache(path).get(key, 0.0)
    if cached and not refresh:
        return cached, True
    peak = max(cached, measure_cpu_peak(precision))
    _write_peak_cache(path, key, peak)
    return peak, False


def device_peak(device: torch.device, precision: str, override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device for MFU, a label saying what that peak is); `override`
    (trainer.peak_flops) wins when > 0. 0.0 when unknown: MFU is then not reported."""
    if override > 0:
        return override, f"{override / 1e12:.3g} TFLOP/s (trainer.peak_flops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        unknown = "peak not in the table, MFU not reported (set trainer.peak_flops)"
        ampere = torch.cuda.get_device_capability(device)[0] >= 8  # bf16 and TF32 tensor cores
        for pattern, half, single in _GPU_PEAKS:
            if re.search(pattern, name):
                break
        else:
            return 0.0, f"{name}: {unknown}"
        if precision == "bf16" and not ampere:
            return 0.0, f"{name} has no bf16 tensor cores (before compute capability 8.0): {unknown}"
        if precision in ("bf16", "fp16"):
            return half, f"{name} dense {precision} {half / 1e12:.3g} TFLOP/s"
        if ampere and _tf32_disabled():
            return 0.0, f"{name} with {TF32_OVERRIDE_ENV}=0 runs fp32 matmuls without TF32: {unknown}"
        kind = "TF32 (fp32 matmuls run as TF32)" if ampere else "fp32"
        return single, f"{name} dense {kind} {single / 1e12:.3g} TFLOP/s"
    peak, cached = cpu_peak(precision)
    how = f"cached in {peak_cache_path()}" if cached else f"measured, cached in {peak_cache_path()}"
    return peak, f"CPU {precision} matmul {peak / 1e9:.3g} GFLOP/s ({how})"


def mfu(flops_per_token: float, tokens_per_sec: float, peak: float, n_devices: float) -> float:
    """Fraction of the peak of all devices that the model's FLOPs use (0 when the peak is unknown)."""
    if peak <= 0:
        return 0.0
    return flops_per_token * tokens_per_sec / (peak * n_devices)


class Peak:
    """The peak one device's MFU divides by during a run (device_peak), checked against what the run
    achieves: MFU is never reported above 1. A measured CPU peak that the run exceeds is measured
    again, once (and the cache file updated); a peak still exceeded, or a table or trainer.peak_flops
    peak exceeded, is flagged by one warning line (on stderr, where `report`) and MFU is 0 (unknown
    peak) from then on. Only the rank that reports MFU (`report`: the tracker rank) looks the peak
    up: on the others it stays 0 (MFU 0, never logged), so a cold cache is measured by one process
    on an otherwise idle machine, not by every rank at once competing for the same cores."""

    def __init__(self, device: torch.device, precision: str, override: float = 0.0, report: bool = True):
        self.precision = precision
        self.report = report
        self.value, self.label = device_peak(device, precision, override) if report else (0.0, "")
        self.source = ("trainer.peak_flops" if override > 0 else
                       f"the cache {peak_cache_path()}" if device.type == "cpu" else "the GPU table")
        self.remeasure = report and override <= 0 and device.type == "cpu"
        self.flagged = False

    def _warn(self, text: str) -> None:
        if self.report:
            print(f"warning: {text}", file=sys.stderr, flush=True)

    def mfu(self, flops_per_token: float, tokens_per_sec: float, n_devices: int) -> float:
        value = mfu(flops_per_token, tokens_per_sec, self.value, n_devices)
        if value <= 1 or self.flagged:
            return 0.0 if self.flagged else value
        achieved = flops_per_token * tokens_per_sec / n_devices
        if self.remeasure:
            self.remeasure = False
            stale = self.value
            self.value = cpu_peak(self.precision, refresh=True)[0]
            self._warn(f"this run achieves {achieved / 1e9:.3g} GFLOP/s per device, above the CPU "
                       f"{self.precision} peak {stale / 1e9:.3g} GFLOP/s from {self.source}: measured "
                       f"again, {self.value / 1e9:.3g} GFLOP/s")
            value = mfu(flops_per_token, tokens_per_sec, self.value, n_devices)
            if value <= 1:
                return value
        self.flagged = True
        self._warn(f"this run achieves {achieved / 1e9:.3g} GFLOP/s per device, above the peak "
                   f"{self.value / 1e9:.3g} GFLOP/s from {self.source}: MFU is reported as 0 (unknown "
                   f"peak) from here on; set trainer.peak_flops to the right peak")
        return 0.0
