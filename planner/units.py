"""Sizes as the planner reads and prints them: `--device-memory` text -> bytes (`parse_bytes`:
40G, 40GB and 40 GB are decimal, 40GiB binary: parallel.options.memory_size), bytes -> a short
decimal string (`fmt_bytes`, GB = 10^9), and the element arithmetic every
module shares (`numel` of a shape, `ceil_div` for the first, longest shard of torch.chunk)."""
from __future__ import annotations

from config import UsageError
from parallel.options import memory_size


def parse_bytes(text: str, what: str = "--device-memory") -> int:
    """'80GB', '80G', '80 GB' (10^9), '80GiB' (2^30), '512MB', '80' (GB) -> bytes; UsageError otherwise."""
    size = memory_size(text)
    if size is None:
        raise UsageError(f"{what} '{text}' is not a memory size; write e.g. 80GB or 80G (10^9 bytes), "
                         f"80GiB (2^30) or 512MB")
    return size


RESERVE_CAP = 3 * 10**9  # CUDA context, NCCL buffers, allocator fragmentation: about 1-3 GB on a GPU


def default_reserve(device_memory: int | None) -> int:
    """Device memory kept for the runtime when none is given: a tenth, at most 3 GB."""
    return 0 if device_memory is None else min(RESERVE_CAP, device_memory // 10)


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
