"""A process's host memory as Linux counts it: its resident set now and its peak (VmRSS, VmHWM in
/proc/PID/status), and the reset of that peak (writing 5 to /proc/PID/clear_refs, Linux 4.0+), so
the peak of one phase of a run can be read apart from what came before it (the benchmarks and
tests that measure what building, training and writing a model cost each process); and how much
freed memory glibc keeps (`return_large_frees`, called at the start of main.py and export.py).
"""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path


def _status_kb(pid: int | str, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def peak_rss(pid: int | str = "self") -> int:
    """Peak resident bytes of a live process since it started or since reset_peak (0 if it is gone)."""
    try:
        return _status_kb(pid, "VmHWM")
    except OSError:
        return 0


def rss(pid: int | str = "self") -> int:
    """Resident bytes of a live process now."""
    return _status_kb(pid, "VmRSS")


def reset_peak(pid: int | str = "self") -> None:
    """Set the process's peak resident set to what it holds now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# glibc's malloc gives a request of 128 KiB or more its own mapping, returned to the kernel when it
# is freed; but each such block freed raises that threshold to its size (up to 32 MiB on 64-bit
# Linux), and from then on blocks of a tensor's size come from the heap, where freed memory between
# live blocks stays with the process. Measured with benchmarks/construction_memory.py (fsdp on 8
# processes, 16 x 1024 GPT): through the first step each worker kept 1.1-1.2x the whole model's
# fp32 bytes resident where its live tensors needed about 0.6x. A fixed threshold (which also stops
# the raising) maps every block above it on its own and returns it when freed: 4 MiB brought the
# 16 x 1024 model to 0.60x but left a 16 x 512 one (its weights 1-4 MiB) at 0.72-0.87x; 1 MiB gave
# 0.60-0.68x there, 256 KiB 0.55-0.60x (tests/test_construction_memory.py's model). Its cost, a
# fresh mapping (and its page faults) per block, is measured by the benchmark's --speed.
MMAP_THRESHOLD = 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


def return_large_frees() -> bool:
    """Make glibc return every freed block of MMAP_THRESHOLD bytes or more to the kernel at once
    (mallopt M_MMAP_THRESHOLD). Not on another C library (no glibc: nothing to change), nor when
    the environment sets glibc's own MALLOC_MMAP_THRESHOLD_ (that choice stands) or
    MINGPT_GLIBC_MALLOC=default (glibc's own behaviour: benchmarks/construction_memory.py compares
    the two). True if set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or os.environ.get("MINGPT_GLIBC_MALLOC") == "default":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
