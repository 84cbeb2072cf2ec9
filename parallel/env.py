"""Process group start-up: this process's rank, world size and device.

Owns `DistEnv`, `init_distributed`, the control group for flags and `shutdown`. torchrun sets
RANK/WORLD_SIZE/LOCAL_RANK; without them the program is one process and no process group is
created. How the world is split into pp x dp x tp is the layout's (parallel/layout.py).
"""
from __future__ import annotations

import datetime
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from config import Config, UsageError
from storage.files import atomic_write

FLIGHT_RECORDER_ENTRIES = 2000  # the newest collectives each rank keeps (a few steps of FSDP's)
DEFAULT_PG_TIMEOUT_S = 600.0  # every process group's; MINGPT_PG_TIMEOUT overrides it
# NCCL's own dump when one of its collectives times out: <run_dir>/NCCL_DUMP_PREFIX<rank>, read by
# `python -m torch.distributed.flight_recorder.fr_trace <run_dir> --prefix nccl_trace_rank_`
NCCL_DUMP_PREFIX = "nccl_trace_rank_"
_PG_TIMEOUT = datetime.timedelta(seconds=DEFAULT_PG_TIMEOUT_S)
GPU_GROUP_BACKEND = "cpu:gloo,cuda:nccl"  # every process group of a GPU run: NCCL for CUDA tensors, gloo for CPU ones


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # precision names -> dtypes


def restart_count() -> int:
    """How many times torchrun's agent has restarted this worker group (TORCHELASTIC_RESTART_COUNT;
    0 on a first launch and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group (a plain `python main.py`)

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def local_world_size(world_size: int) -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE; a single process: the world)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def cpu_devices(world_size: int, local_world_size: int) -> tuple[float, str | None]:
    """How many measured CPU peaks a CPU launch really has: the peak is one process's, on the
    threads it uses (torch.get_num_threads), so a node whose processes ask for more threads than it
    has cores gives only cores / threads of them. Returns (devices over all nodes, a warning line
    when the node is oversubscribed, else None)."""
    threads, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    per_node = min(float(local_world_size), cores / threads)
    note = None
    if local_world_size * threads > cores:
        note = (f"{local_world_size} processes x {threads} thread(s) share {cores} cores: the node is "
                f"oversubscribed, so MFU divides by the {per_node:g} process peaks its cores give, not "
                f"{local_world_size}; launch at most {max(1, cores // threads)} processes per node for speed")
    return per_node * world_size / local_world_size, note


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def write_error_file(line: str, callstack: str | None = None) -> None:
    """`line` as torchrun's failure summary shows it for this worker (TORCHELASTIC_ERROR_FILE;
    nothing outside torchrun), with `callstack` as its traceback (default: the line itself)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line if callstack is None else callstack,
                                                         "timestamp": str(int(time.time()))}}}

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
    # whole or not at all: torchrun's agent reads the file as soon as the worker is gone, and a
    # worker killed while writing it (a second signal, torchrun's own SIGKILL of the group) left it
    # empty, on which the agent itself crashed (json.decoder.JSONDecodeError) instead of restarting
    # the group
    atomic_write(Path(path), write)


def pick_device(cfg: Config, local_rank: int, config_file: str | None = None,
                local_processes: int = 1) -> torch.device:
    """`config_file`: the config that set trainer.device (None: an override did), named in the refusal.
    `local_processes`: the processes of this launch on this node; on CUDA each needs a GPU of its own
    (NCCL refuses two ranks on one GPU, with a traceback deep in the first collective), so more
    processes than GPUs are refused here, on every rank alike, with one line."""
    want = cfg.trainer.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            who = f"{config_file} sets trainer.device: cuda (a GPU config)" if config_file else "trainer.device=cuda"
            raise UsageError(f"{who} but torch {torch.__version__} sees no CUDA device; run it on a GPU "
                             f"machine, or give the override trainer.device=cpu to run it on this CPU")
        gpus = torch.cuda.device_count()
        if local_processes > gpus:
            raise UsageError(f"this node runs {local_processes} processes but torch sees {gpus} GPU"
                             f"{'s' if gpus != 1 else ''}, and NCCL needs one GPU per process; launch "
                             f"torchrun --nproc_per_node={gpus} (or check CUDA_VISIBLE_DEVICES)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def deterministic_mode(enabled: bool) -> None:
    """trainer.deterministic: kernels that give the same bits on every run, so that a run resumed
    from a snapshot ends bit-identical to an uninterrupted one on a GPU too (CPU kernels already do).
    torch.use_deterministic_algorithms makes an op without a deterministic kernel raise instead of
    running; cuBLAS needs a fixed workspace for it (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts:
    so this runs before any CUDA work). https://pytorch.org/docs/stable/notes/randomness.html"""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def pg_timeout() -> datetime.timedelta:
    """The timeout of every process group of this launch (init_distributed's; MINGPT_PG_TIMEOUT)."""
    return _PG_TIMEOUT


def new_group(**kwargs):
    """Collective. dist.new_group with this launch's timeout: a group made without one gets torch's
    backend default (30 min on gloo, 10 on NCCL), not the default group's."""
    return dist.new_group(timeout=pg_timeout(), **kwargs)


def time_out_mesh(mesh) -> None:
    """Give every process group of `mesh` (each dimension, and the flattened ones) this launch's
    timeout: init_device_mesh's sub-groups get the backend's default (30 min on gloo), so a hang in
    a sub-group would outwait the default group's timeout and the hang watchdog's budget."""
    from torch.distributed.distributed_c10d import _set_pg_timeout  # private, torch 2.11-2.13; torchtitan uses it
    if dist.get_backend() == "fake":  # the dry run's simulated ranks: no timeout to set
        return
    names = {*(mesh.mesh_dim_names or ()), *getattr(mesh, "_flatten_mapping", {})}  # the flattened: e.g. HSDP's "dp"
    for name in sorted(names):
        _set_pg_timeout(pg_timeout(), mesh.get_group(name))


def init_distributed(cfg: Config, timeout_s: float | None = None, config_file: str | None = None) -> DistEnv:
    """Start the process group when launched by torchrun (gloo on CPU; on CUDA nccl, plus gloo
    for CPU tensors)."""
    global _PG_TIMEOUT
    deterministic_mode(cfg.trainer.deterministic)  # before any CUDA work
    if not launched_by_torchrun():
        return DistEnv(device=pick_device(cfg, 0, config_file))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(cfg, local_rank, config_file, local_world_size(world))
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("MINGPT_PG_TIMEOUT", DEFAULT_PG_TIMEOUT_S)))
    _PG_TIMEOUT = timeout
    # On CUDA, CPU tensors get gloo in the same group: FSDP2's CPU offload keeps the sharded gradients
    # on the CPU and the gradient norm all-reduces them; NCCL alone refuses CPU tensors (pytorch#148532).
    group_backend = GPU_GROUP_BACKEND if backend == "nccl" else backend
    if cfg.trainer.hang_timeout_s or backend == "nccl":  # the hang watchdog reads it (guards/watchdog.py); NCCL dumps it
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    if backend == "nccl":  # read when the NCCL group starts (the dump's file name: when it dumps)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # a timed-out collective dumps NCCL's recorder ...
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",  # ... into the run folder, not the node's /tmp
                              str(Path(cfg.trainer.run_dir).expanduser().absolute() / NCCL_DUMP_PREFIX))
    if not dist.is_initialized():
        dist.init_process_group(backend=group_backend, timeout=timeout, store=_rendezvous_store(rank, world, timeout),
                                rank=rank, world_size=world,
                                device_id=device if device.type == "cuda" else None)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


def _rendezvous_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The store the process group meets in, namespaced per torchrun restart attempt.

    By default torchrun's workers share the agent's rendezvous TCPStore across restarts. After a
    worker is killed, the keys that the previous attempt's process group wrote (each rank's gloo
    address, barrier counters) are still there, and the restarted ranks may read them: about half
    the restarts then fail with "Connection refused" or hang (pytorch#135712). Prefixing every key
    with the restart attempt gives each attempt a clean namespace. On one node the attempt number
    (TORCHELASTIC_RESTART_COUNT) is the same for every worker, since one agent restarts them all.
    Across nodes each agent counts its own restarts, so there we keep torch's default and
    docs/scaling-out.md asks for TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives every
    rendezvous round a fresh store of its own (shared_store_advice warns when it is missing).
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if agent_store:  # the agent hosts the store; every worker is a client
        store = dist.TCPStore(host, port, world_size=world, is_master=False, timeout=timeout)
    else:  # rank 0 hosts a store of its own (static launch, or a fresh store per round)
        store = dist.TCPStore(host, port, world_size=world, is_master=rank == 0, timeout=timeout,
                              multi_tenant=True)
    single_node = int(os.environ.get("GROUP_WORLD_SIZE", "1")) == 1
    if agent_store and single_node:
        return dist.PrefixStore(store_namespace(), store)
    if rank == 0 and (advice := shared_store_advice(os.environ)):
        warnings.warn(advice, stacklevel=2)
    return store


def store_namespace() -> str:
    """The key prefix of this launch attempt in the rendezvous store (see _rendezvous_store)."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    single_node = int(os.environ.get("GROUP_WORLD_SIZE", "1")) == 1
    return f"mingpt/attempt{restart_count()}" if agent_store and single_node else "mingpt"


def side_store(name: str, timeout_s: float) -> dist.Store:
    """A client connection of its own to the rendezvous store, keys under `name` in this attempt's
    namespace, for a thread that must reach the other ranks while the training thread may be
    blocked (the hang watchdog): a connection shared with the process group could be held by a
    blocked call. Raises (RuntimeError, OSError) when the store does not answer."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                           wait_for_workers=False)
    return dist.PrefixStore(f"{store_namespace()}/{name}", client)


def shared_store_advice(environ) -> str | None:
    """The warning for a multi-node torchrun whose workers share the agents' rendezvous store:
    restarts there can fail or hang (pytorch#135712), and no per-attempt prefix can help across
    agents that count their restarts apart (see _rendezvous_store). None when the launch is fine."""
    multi_node = int(environ.get("GROUP_WORLD_SIZE", "1")) > 1
    if multi_node and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ("this multi-node job shares torchrun's rendezvous store with its workers, so a restart "
                "after a failure can fail or hang (pytorch#135712); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                "on every node before torchrun (docs/scaling-out.md)")
    return None


_CONTROL_GROUP = None


def control_group():
    """Collective on first use. A gloo group over every rank for control flags (the stop vote):
    its tensors live on the CPU, so agreeing on a flag never waits for the GPU's queue, and its
    collectives never interleave with the training's own on the default group."""
    global _CONTROL_GROUP
    if _CONTROL_GROUP is None:
        _CONTROL_GROUP = new_group(backend="gloo")
    return _CONTROL_GROUP


def shutdown() -> None:
    global _CONTROL_GROUP
    _CONTROL_GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()
