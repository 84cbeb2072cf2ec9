"""A process's host memory as Linux counts it: its resident set now and its peak (VmRSS, VmHWM in
/proc/PID/status), and the reset of that peak (writing 5 to /proc/PID/clear_refs, Linux 4.0+), so
the peak of one phase of a run can be read apart from what came before it (the benchmarks and
tests that measure what building, training and writing a model cost each process); and how much
freed memory glibc keeps: every large block returned to the kernel while the model is built and
loaded (`return_large_frees`, called at the start of main.py and export.py), the step's blocks kept
for the next step while it trains (`reuse_step_memory`, around launch/app.py's training loop).
"""
from __future__ import annotations

import contextlib
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
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


# While it trains, a step allocates the same temporaries every step (activations, gradients,
# buckets, gathered parameters): returned to the kernel at each free, each is mapped and faulted in
# again the next step. Measured on 2 cores (4 x 256 GPT, block 128, batch 16 at 2 processes, ddp /
# fsdp / zero-1): 300 / 388 / 338 ms a step with the 1 MiB threshold, 232 / 302 / 255 ms with
# blocks up to 32 MiB kept in the heap and the heap never trimmed, 272 / 307 / 282 ms with glibc's
# own behaviour (benchmarks/strategy_report.py, each setting from the environment); one process, 8
# sequences: 278-293 against 214-220 ms. Kept: the largest threshold glibc takes on 64-bit Linux
# (DEFAULT_MMAP_THRESHOLD_MAX) and a trim threshold of 1 GiB; resident memory
# then holds the heap's high-water mark between steps, more than the step's live peak: fsdp on 8
# processes (tests/test_construction_memory.py's 16 x 512 model) held 1.9-3.6x the model's fp32
# bytes through the first step against 0.15-0.8x lean. So it is a choice, trainer.host_memory
# (default lean: the layouts' memory as promised).
STEP_MMAP_THRESHOLD = 32 * 2**20
STEP_TRIM_THRESHOLD = 2**30
GLIBC_TRIM_THRESHOLD = 128 * 2**10  # glibc's default M_TRIM_THRESHOLD
_M_TRIM_THRESHOLD = -1


def _glibc():
    """glibc with its mallopt, or None (another C library; or the environment chose:
    MALLOC_MMAP_THRESHOLD_ set, or MINGPT_GLIBC_MALLOC=default)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or os.environ.get("MINGPT_GLIBC_MALLOC") == "default":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


@contextlib.contextmanager
def reuse_step_memory(enabled: bool = True):
    """trainer.host_memory=reuse (`enabled`). Inside: glibc keeps freed blocks below
    STEP_MMAP_THRESHOLD in the heap and never trims it below STEP_TRIM_THRESHOLD, so each step
    reuses the last one's memory instead of faulting fresh pages in. After: lean, return_large_frees's
    setting (main.py's from its start, whatever the process had before), and the kept memory
    returned (malloc_trim). Nothing changes where return_large_frees would not (the same
    exceptions), nor where glibc refuses the 32 MiB threshold (it takes at most 32 MiB on 64-bit
    Linux, less on 32-bit): then the trim threshold goes back too."""
    libc = _glibc() if enabled else None
    if libc is None:
        yield
        return
    mallopt = libc.mallopt
    if mallopt(_M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD) != 1 or mallopt(_M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD) != 1:
        mallopt(_M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)
        yield
        return
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)
        libc.malloc_trim(0)
