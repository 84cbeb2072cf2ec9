"""trainer.precision=auto: the fastest precision the device has, chosen at launch from what it
reports, and the one start-up line that says which and why.

On a CPU the choice is a function of the instruction-set flags the kernel lists in /proc/cpuinfo
(`fastest_cpu_precision`, tested on flag sets without the hardware): bf16 autocast where the CPU
has bf16 instructions (AVX512_BF16, or AMX's tile unit, `amx_bf16`), where oneDNN's bf16 matmuls
run 3.5-4.4x the fp32 rate at nanoGPT's CPU shapes (an EPYC with AVX512_BF16); fp32 where it has
none: there torch emulates bf16 in software, slower than fp32 (a 512^3 bf16 matmul 0.2 s on an
AVX2 EPYC). On a GPU: bf16 where it has bf16 tensor cores (torch.cuda.is_bf16_supported), else fp32.
The resolved value replaces `auto` in the config before anything is built, so config.yaml, the
MFU peak (measured in the dtype that runs: observe/perf.py) and every engine see it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from config import Config

# The CPU flags (Linux's names) of bf16 dot-product instructions oneDNN's bf16 kernels use.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The flags of the first CPU listed in `cpuinfo` (every core of a machine has the same); an
    unreadable or flagless file (not Linux) reads as no flags: the safe choice is then fp32."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def fastest_cpu_precision(flags: set[str]) -> tuple[str, str]:
    """(precision, why) for a CPU with these flags: bf16 with bf16 instructions, else fp32."""
    have = [f for f in BF16_FLAGS if f in flags]
    if have:
        return "bf16", f"bf16 autocast: this CPU has {' and '.join(have)}"
    return "fp32", (f"fp32: this CPU reports neither {' nor '.join(BF16_FLAGS)} (no bf16 instructions; "
                    f"bf16 would be emulated, slower than fp32)")


def fastest_precision(device: torch.device, flags: set[str] | None = None) -> tuple[str, str]:
    """(precision, why) of trainer.precision=auto on `device` (a CPU's `flags`: its own by default)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", f"bf16 autocast: {torch.cuda.get_device_name(device)} has bf16 tensor cores"
        return "fp32", f"fp32: {torch.cuda.get_device_name(device)} has no bf16 tensor cores"
    return fastest_cpu_precision(cpu_flags() if flags is None else flags)


def resolve_precision(cfg: Config, device: torch.device) -> tuple[Config, str | None]:
    """(the config with trainer.precision=auto replaced by its choice, the start-up line saying
    so); any other value: (cfg, None) unchanged."""
    if cfg.trainer.precision != "auto":
        return cfg, None
    precision, why = fastest_precision(device)
    trainer = dataclasses.replace(cfg.trainer, precision=precision)
    return dataclasses.replace(cfg, trainer=trainer), f"precision: trainer.precision=auto runs {why}"
