"""Sizes as the planner reads and prints them: `--device-memory` text -> bytes (`parse_bytes`),
bytes -> a short decimal string (`fmt_bytes`, GB = 10^9), and the element arithmetic every
module shares (`numel` of a shape, `ceil_div` for the first, longest shard of torch.chunk)."""
from __future__ import annotations

import re

from config import UsageError

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB', '80 GiB', '512MB', '80' (GB) -> bytes; UsageError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text or "")
    unit = (m.group(2) or "gb").lower() if m else ""
    if not m or unit not in UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"--device-memory '{text}' is not a memory size; write e.g. 80GB, 80GiB or 512MB")
    return int(float(m.group(1)) * UNITS[unit])


def fmt_bytes(n: float) -> str:
    if n >= 10**9:
        return f"{n / 10**9:.2f} GB"
    if n >= 10**6:
        return f"{n / 10**6:.1f} MB"
    if n >= 10**3:
        return f"{n / 10**3:.1f} kB"
    return f"{n:.0f} B"


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
