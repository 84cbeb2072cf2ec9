"""`--hardware local` as the planner reads it: this machine's figures from the cache that
tools/calibrate.py fills (measured once per machine, keyed like observe/perf.py's CPU peak cache by
CPU model, its instruction sets, threads and torch version), or the UNCALIBRATED defaults where none is cached and the
caller passes no `measure` (a launch under torchrun, whose cores are busy, never measures).
Every local link is one class: there is no second node to measure, so inter_node = intra_node.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

from observe.perf import cpu_peak, machine_fingerprint, peak_cache_path
from storage.files import atomic_write_text

UNCALIBRATED = {"latency": 100e-6, "bandwidth": 1e9, "memory_bandwidth": 5e9, "block_overhead": 1e-3,
                "compute_efficiency": 0.7, "tp_overhead": 0.0, "fsdp_overhead": 0.0, "sp_overhead": 0.0,
                "step_overhead": 0.0, "busy_node_slowdown": 1.0, "elementwise": 0.0,
                "gather_latency": 100e-6, "gather_bandwidth": 1e9, "scatter_latency": 100e-6, "scatter_bandwidth": 1e9,
                "split_backward_overhead": 0.0, "split_backward_elementwise": 0.0, "fsdp_copy": 0.0,
                "dtensor_optimizer_overhead": 0.0, "near_latency": 100e-6, "near_gather_latency": 100e-6,
                "near_scatter_latency": 100e-6, "latency_gap": 0.0, "cp_ring_overhead": 0.0,
                "cp_ring_elementwise": 0.0, "cp_allgather_overhead": 0.0, "cp_allgather_elementwise": 0.0,
                "fsdp_call_latency": 0.0}
# figures calibrated since some committed calibrations were made (docs/grid-*): an entry without
# them is still current, and prices what they measure as planner/hardware.py says for their absence
# 2026-11-29: ZeRO-1/2's packing, sequence parallelism's cost per activation element (tools/calibrate_engines.py),
# each matmul call's cost per weight element (tools/calibrate.py weight_pass_rate), the
# vocabulary-parallel head's host work (tools/calibrate_engines.py), FSDP2's bytes in its own pattern
# (tools/calibrate.py)
ADDED_SINCE = {"zero_overhead": 0.0, "zero_copy": 0.0, "sp_elementwise": 0.0, "weight_pass": 0.0,
               "vocab_overhead": 0.0, "fsdp_byte_time": 0.0}


def cache_path() -> Path:
    return peak_cache_path().with_name("local-hardware.json")


def worker_threads() -> int:
    """The threads of one rank of a local launch: OMP_NUM_THREADS when set, else 1, what torchrun
    sets for each worker of a multi-process launch (torch/distributed/run.py)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


@contextlib.contextmanager
def _rank_threads():
    """torch at the threads a rank runs with (worker_threads), which the figures and their cache
    key are measured at, whatever the calling shell's."""
    previous = torch.get_num_threads()
    torch.set_num_threads(worker_threads())
    try:
        yield worker_threads()
    finally:
        torch.set_num_threads(previous)


def cache_key() -> str:
    """This machine's key in the cache, at the threads a rank runs with."""
    with _rank_threads():
        return machine_fingerprint("local hardware")


def holds_this_machine(path: Path) -> bool:
    """Does the cache file at `path` hold this machine's figures (its key, at a rank's threads)?"""
    return cache_key() in _read(path)


def local_figures(precision: str, measure: Callable[[], dict] | None = None) -> dict:
    """This machine as a hardware description (planner/hardware.py's YAML keys), for the threads a
    rank runs with (worker_threads), not this shell's: a plan from a plain shell predicts the
    torchrun launch. `measure` (tools/calibrate.py's measure_local) runs where nothing is cached;
    None: the UNCALIBRATED figures."""
    with _rank_threads() as threads:
        figures = _local_figures(precision, measure)
    figures["source"] += (f", {threads} thread{'s' if threads > 1 else ''} per rank: OMP_NUM_THREADS"
                          f"{'' if 'OMP_NUM_THREADS' in os.environ else ' unset, as torchrun sets it (1)'}")
    return figures


def _local_figures(precision: str, measure: Callable[[], dict] | None) -> dict:
    threads = torch.get_num_threads()
    per_node = max(1, len(os.sched_getaffinity(0)) // threads)
    key = cache_key()
    path = cache_path()
    cached = _read(path).get(key)
    how = f"cached in {path}"
    if not current(cached):
        if measure is not None:
            cached, how = measure(), f"measured, cached in {path}"
            _store(path, key, cached)
        else:
            cached, how = dict(UNCALIBRATED), "UNCALIBRATED defaults: run `python main.py --plan` once to measure"
    peak = cpu_peak(precision)[0]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # each link's latency after the calibration's compute gap and right after another call (near)
    link = {"bandwidth": cached["bandwidth"], "latency": cached["latency"], "near_latency": cached["near_latency"]}
    return {"name": "local", "source": f"this machine ({how})", "devices_per_node": per_node,
            "memory": f"{ram // per_node}B", "peak_flops": {precision: peak, "fp32": cpu_peak("fp32")[0]},
            "memory_bandwidth": cached["memory_bandwidth"], "intra_node": link, "inter_node": link,
            "compute_efficiency": cached["compute_efficiency"], "block_overhead": cached["block_overhead"],
            "tp_overhead": cached["tp_overhead"], "fsdp_overhead": cached["fsdp_overhead"],
            "sp_overhead": cached["sp_overhead"], "step_overhead": cached["step_overhead"],
            "busy_node_slowdown": cached["busy_node_slowdown"], "elementwise": cached["elementwise"],
            # torch's zero-bubble split backward beyond a full one (tools/calibrate.py split_rates)
            "split_backward_overhead": cached["split_backward_overhead"],
            "split_backward_elementwise": cached["split_backward_elementwise"],
            # FSDP2's copies per parameter element, AdamW's DTensor dispatch per tensor (tools/calibrate_engines.py)
            "fsdp_copy": cached["fsdp_copy"], "dtensor_optimizer_overhead": cached["dtensor_optimizer_overhead"],
            "latency_gap": cached["latency_gap"],
            # an FSDP2 gather or reduce-scatter on gloo in FSDP2's own pattern (tools/calibrate.py)
            "fsdp_call_latency": cached["fsdp_call_latency"],
            # context parallelism's attention beyond one fused attention (tools/calibrate_engines.py)
            **{key: cached[key] for key in ("cp_ring_overhead", "cp_ring_elementwise", "cp_allgather_overhead",
                                            "cp_allgather_elementwise")},
            # ZeRO-1/2's packing around its collectives, sequence parallelism per element, each matmul
            # call's weight pass, the vocabulary-parallel head, FSDP2's bytes (tools/calibrate_engines.py,
            # tools/calibrate.py)
            **{key: cached.get(key, absent) for key, absent in ADDED_SINCE.items()},
            # gloo's all-gather and all-to-all (the engines' reduce-scatter) at their own rates
            "all_gather_link": {"bandwidth": cached["gather_bandwidth"], "latency": cached["gather_latency"],
                                "near_latency": cached["near_gather_latency"]},
            "reduce_scatter_link": {"bandwidth": cached["scatter_bandwidth"], "latency": cached["scatter_latency"],
                                    "near_latency": cached["near_scatter_latency"]},
            "overlap": False,  # one process per core: the cores do the collectives' work (planner/hardware.py)
            "shared_node": True,  # a local launch of more ranks than cores shares them
            "reduce_scatter_as_all_reduce": True}  # gloo's reduce_scatter_tensor is an all-reduce


def current(cached) -> bool:
    """Does a cache entry hold every figure the model reads? One with more (an older calibration's
    keys that nothing prices any more) is current too: a replan of a committed grid measures nothing."""
    return isinstance(cached, dict) and set(UNCALIBRATED) <= set(cached)


def _read(path: Path) -> dict:
    """The cached figures; a missing or damaged file reads as none (measured again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(path: Path, key: str, figures: dict) -> None:
    data = _read(path)
    data[key] = figures
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError:  # a cache only: the next plan measures again
        pass
