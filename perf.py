"""Throughput accounting: the peak FLOP/s that MFU is measured against, and MFU itself.

MFU = achieved model FLOP/s / peak FLOP/s of the devices the layout uses, with model FLOPs from
`GPT.flops_per_token` (6N + 12LCT). On CUDA the peak comes from a table of dense bf16/fp16 and
fp32-matmul specs; fp32 matmuls run on TF32 tensor cores there (`set_fp32_matmul_mode`, as
nanoGPT and most training scripts do), so the fp32 peak is the TF32 one on GPUs that have TF32
(compute capability 8.0 and later) and the plain fp32 one before. On CPU there is no spec to
trust, so we measure it: the best of a few large matmuls in the training's own dtype (fp32, or
bf16/fp16 under autocast) on the threads this process is allowed to use. The benchmark prints that
measured peak next to its MFU.
"""
from __future__ import annotations

import time

import torch

# Dense (no sparsity) peak FLOP/s per GPU, by name fragment: (bf16/fp16 tensor cores, fp32
# matmuls as run here: TF32 tensor cores where the GPU has them, else plain fp32).
_GPU_PEAKS = {
    "H200": (989e12, 494e12),
    "H100": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "A10G": (125e12, 62.5e12),  # the A10 datasheet's dense figures (no separate A10G datasheet)
    "L4": (121e12, 60e12),
    "V100": (125e12, 15.7e12),  # no TF32 (compute capability 7.0): plain fp32
    "4090": (165e12, 82e12),
}
_MATMUL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_cpu_peak_cache: dict[tuple[int, torch.dtype], float] = {}


def set_fp32_matmul_mode(device: torch.device) -> None:
    """fp32 matmuls and convolutions on CUDA run on TF32 tensor cores (10-bit mantissa inputs,
    fp32 accumulation): what users expect of a GPU training script, and what the peak table
    assumes. CPU numerics are left alone. (The legacy allow_tf32 switches: mixing them with the
    newer fp32_precision API makes torch.get_float32_matmul_precision raise, which inductor calls.)"""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


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


def device_peak(device: torch.device, precision: str, override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device for MFU, a label saying what that peak is); `override`
    (trainer.peak_flops) wins when > 0. 0.0 when unknown: MFU is then not reported."""
    if override > 0:
        return override, f"{override / 1e12:.3g} TFLOP/s (trainer.peak_flops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, single) in _GPU_PEAKS.items():
            if key in name:
                if precision in ("bf16", "fp16"):
                    return half, f"{name} dense {precision} {half / 1e12:.3g} TFLOP/s"
                tf32 = torch.cuda.get_device_capability(device)[0] >= 8
                kind = "TF32 (fp32 matmuls run as TF32)" if tf32 else "fp32"
                return single, f"{name} dense {kind} {single / 1e12:.3g} TFLOP/s"
        return 0.0, f"{name}: unknown peak, MFU not reported (set trainer.peak_flops)"
    # fp16: torch's CPU fp16 matmul is a slow generic kernel (measured 0.4 GFLOP/s at 1024^3, a
    # 6 s start-up); at 256^3 the measurement takes a fraction of a second.
    n = 256 if precision == "fp16" else 1024
    peak = measure_cpu_matmul_peak(n=n, dtype=_MATMUL_DTYPES[precision])
    return peak, f"CPU {precision} {n}^3 matmul, measured {peak / 1e9:.3g} GFLOP/s"


def device_peak_flops(device: torch.device, precision: str, override: float = 0.0) -> float:
    """Peak FLOP/s of one device for MFU (device_peak without its label)."""
    return device_peak(device, precision, override)[0]


def mfu(flops_per_token: float, tokens_per_sec: float, peak: float, n_devices: int) -> float:
    """Fraction of the peak of all devices that the model's FLOPs use (0 when the peak is unknown)."""
    if peak <= 0:
        return 0.0
    return flops_per_token * tokens_per_sec / (peak * n_devices)
