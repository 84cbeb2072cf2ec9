"""Throughput accounting: the peak FLOP/s that MFU is measured against, and MFU itself.

MFU = achieved model FLOP/s / peak FLOP/s of the devices used, with model FLOPs from
`GPT.flops_per_token` (6N + 12LCT). On CUDA the peak comes from a table of dense bf16/fp32 specs;
on CPU there is no spec to trust, so we measure it: the best of a few large fp32 matmuls on the
threads this process is allowed to use. The benchmark prints that measured peak next to its MFU.
"""
from __future__ import annotations

import time

import torch

# Dense (no sparsity) peak FLOP/s per GPU, by name fragment: (bf16/fp16, tf32-or-fp32).
_GPU_PEAKS = {
    "H200": (989e12, 494e12),
    "H100": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "A10G": (125e12, 31e12),
    "L4": (121e12, 60e12),
    "V100": (125e12, 15.7e12),
    "4090": (165e12, 82e12),
}

_cpu_peak_cache: dict[int, float] = {}


def measure_cpu_matmul_peak(n: int = 1024, repeats: int = 5, min_seconds: float = 0.0,
                            refresh: bool = False) -> float:
    """Best observed fp32 FLOP/s of an n x n matmul on this process's threads (2 n^3 FLOPs), over
    at least `repeats` runs and `min_seconds`. The best run, not the mean: on a shared machine a
    neighbour's work only ever slows a run down, so the fastest one is closest to the hardware.
    Cached per thread count; `refresh` measures again (returning this measurement) and caches the
    higher of the two."""
    threads = torch.get_num_threads()
    if threads in _cpu_peak_cache and not refresh:
        return _cpu_peak_cache[threads]
    g = torch.Generator().manual_seed(0)  # its own RNG: measuring must not shift training's stream
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b  # warm-up (thread pool, caches)
    best, runs, start = float("inf"), 0, time.perf_counter()
    while runs < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        runs += 1
    measured = 2 * n ** 3 / best
    _cpu_peak_cache[threads] = max(measured, _cpu_peak_cache.get(threads, 0.0))
    return measured


def device_peak_flops(device: torch.device, precision: str, override: float = 0.0) -> float:
    """Peak FLOP/s of one device for MFU; `override` (trainer.peak_flops) wins when > 0."""
    if override > 0:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, single) in _GPU_PEAKS.items():
            if key in name:
                return half if precision in ("bf16", "fp16") else single
        return 0.0  # unknown GPU: MFU is not reported rather than guessed
    return measure_cpu_matmul_peak()


def mfu(flops_per_token: float, tokens_per_sec: float, peak: float, n_devices: int) -> float:
    """Fraction of the peak of all devices that the model's FLOPs use (0 when the peak is unknown)."""
    if peak <= 0:
        return 0.0
    return flops_per_token * tokens_per_sec / (peak * n_devices)
