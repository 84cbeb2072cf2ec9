"""What a layout really holds, moves and waits for on one rank: the measuring side of planner.py.

Used by tests/plan_worker.py (the planner's tests), benchmarks/strategy_report.py (predicted vs
measured per layout), benchmarks/bytes_per_strategy.py and benchmarks/pp_bubble.py.

- `SavedBytes`: the bytes autograd saves for backward (torch.autograd.graph.saved_tensors_hooks),
  each storage once, parameters excluded, a DTensor by its local shard.
- `HeldPeak` (tools/held_memory.py): the tensor bytes the process really holds through a step.
- `CollectiveCounter`: every collective and point-to-point op this process issues, with its payload bytes, counted at the
  dispatcher (a TorchDispatchMode). Python wrappers of torch.distributed would miss most of them:
  DDP's reducer calls ProcessGroup::allreduce from C++, DTensor (tp) and FSDP2 go through the
  functional collectives (`torch.ops._c10d_functional.*`) or straight to the c10d ops. All of these
  reach the dispatcher as `torch.ops.c10d.*` (allreduce_, _allgather_base_, _reduce_scatter_base_,
  alltoall_base_, send, recv_, ...) or `torch.ops._c10d_functional.*`; a functional collective is
  counted once, as itself (inside the mode's handler the mode is off, so the c10d op it issues
  underneath is not seen again). Like torch's own CommDebugMode, the mode steps aside for DTensor
  operations (NotImplemented) so that DTensor's desugared collectives on plain tensors are seen.
- `AllocationPeak`: the peak of live tensor bytes while a piece of code runs (the dry run's model
  construction), each storage counted from the operation that creates it until it is freed.
- `loopback_tx_bytes`: bytes the `lo` interface has transmitted (/proc/net/dev), i.e. the wire
  bytes of every local rank together, TCP/IP headers included.
- `StageClock`: busy time of pipeline stages, for the measured bubble 1 - busy / step time.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel.cp import Ring
from parallel.dtensor import storage_id


class SavedBytes:
    """Counts the storages autograd saves for backward, each once (by `storage_id`). Holding a
    reference to every storage keeps a freed one's identity from going to the next tensor."""

    def __init__(self):
        self.storages: dict[int, torch.UntypedStorage] = {}

    def pack(self, t: torch.Tensor):
        # a weight (or its transposed view, which F.linear saves) is a parameter, not an activation
        if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
            local = t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard
            self.storages.setdefault(storage_id(local), local.untyped_storage())
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes() for st in self.storages.values())


# ----------------------------------------------------------------------------- collectives


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


# op name -> (kind, which argument is the payload K). K is what the planner calls a collective's
# payload: the whole reduced tensor (all-reduce), the whole input of a reduce-scatter or an
# all-to-all, the whole gathered output of an all-gather, what a send sends.
_C10D = {
    "allreduce_": ("all-reduce", 0), "allreduce_coalesced_": ("all-reduce", 0),
    "_allgather_base_": ("all-gather", 0), "allgather_": ("all-gather", 0),
    "allgather_into_tensor_coalesced_": ("all-gather", 0), "allgather_coalesced_": ("all-gather", 0),
    "_reduce_scatter_base_": ("reduce-scatter", 1), "reduce_scatter_": ("reduce-scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce-scatter", 1),
    "alltoall_base_": ("all-to-all", 1), "alltoall_": ("all-to-all", 1),
    "broadcast_": ("broadcast", 0), "send": ("send", 0), "recv_": ("recv", 0),
    "reduce_": ("reduce", 0), "gather_": ("gather", 1), "scatter_": ("scatter", 0),
}
# functional collectives (DTensor, FSDP2's reshard paths): (kind, payload multiplier by group size)
_FUNCOL = {
    "all_reduce": ("all-reduce", False), "all_reduce_": ("all-reduce", False),
    "all_reduce_coalesced": ("all-reduce", False), "all_reduce_coalesced_": ("all-reduce", False),
    "all_gather_into_tensor": ("all-gather", True), "all_gather_into_tensor_out": ("all-gather", True),
    "all_gather_into_tensor_coalesced": ("all-gather", True),
    "reduce_scatter_tensor": ("reduce-scatter", False), "reduce_scatter_tensor_coalesced": ("reduce-scatter", False),
    "all_to_all_single": ("all-to-all", False), "broadcast": ("broadcast", False), "broadcast_": ("broadcast", False),
}


def ring_moved(kind: str, payload: int, n: int) -> float:
    """Bytes one rank sends for a collective of `payload` bytes over n ranks, on a ring (the
    planner's volumes): all-reduce 2K(n-1)/n, reduce-scatter, all-gather and all-to-all K(n-1)/n,
    a send K, a receive nothing."""
    if n <= 1 or kind == "recv":
        return 0.0
    if kind == "all-reduce":
        return 2 * payload * (n - 1) / n
    if kind == "send":
        return float(payload)
    return payload * (n - 1) / n


@dataclass
class Call:
    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | send | recv | broadcast | ...
    op: str  # the dispatcher op, e.g. c10d.allreduce_ or _c10d_functional.all_reduce
    ranks: tuple[int, ...]  # global ranks of the group
    payload: int  # bytes (see _C10D)
    phase: str = ""  # CollectiveCounter.phase when it was issued

    @property
    def moved(self) -> float:
        return ring_moved(self.kind, self.payload, len(self.ranks))


def _group_ranks(args) -> tuple[int, ...]:
    """Global ranks (sorted) of the group a collective's arguments name: a c10d op gets the
    ProcessGroup as a TorchScript object, a functional collective its name."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith("c10d.ProcessGroup"):
            return tuple(sorted(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a))))
        if isinstance(a, str):  # a functional collective's group name
            try:
                pg = dist.distributed_c10d._resolve_process_group(a)
            except (ValueError, RuntimeError, KeyError):
                continue
            return tuple(sorted(dist.get_process_group_ranks(pg)))
    raise ValueError(f"no process group among the arguments of a collective: {[type(a) for a in args]}")


class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter() as c:` records every collective this process issues in c.calls,
    each tagged with `c.phase` (set it around a part of the step to tell its collectives apart)."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run; its collectives on local tensors come back here
        out = func(*args, **kwargs)
        ns, name = getattr(func, "namespace", ""), func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else ""
        if ns == "c10d" and name in _C10D:
            kind, i = _C10D[name]
            self.calls.append(Call(kind, f"c10d.{name}", _group_ranks(args), _nbytes(args[i]), self.phase))
        elif ns in ("_c10d_functional", "_c10d_functional_autograd") and name in _FUNCOL:
            kind, gathered = _FUNCOL[name]
            ranks = _group_ranks(list(args) + list(kwargs.values()))
            payload = _nbytes(args[0]) * (len(ranks) if gathered else 1)
            self.calls.append(Call(kind, f"{ns}.{name}", ranks, payload, self.phase))
        return out


class AllocationPeak(TorchDispatchMode):
    """`with AllocationPeak() as a:` the peak of live tensor bytes while entered, in `a.peak`
    ("device" and "host"). Every storage an operation returns is counted once (by `storage_id`)
    from then until its StorageImpl is freed: a weakref finalizer on the storage, whose Python object
    torch keeps for as long as the storage lives (fake storages too). Meta tensors hold no memory;
    DTensors are counted by their local tensors (the mode steps aside for DTensor operations, as
    CollectiveCounter does). What `host(fn)` allocates while it runs is host memory; the rest is
    the device's. Not counted: storages alive before the mode was entered, integer tensors (the
    bookkeeping of DeviceMesh's rank tables and DTensor's shard offsets, a few bytes per rank of the
    world, on the CPU; a model's tensors are floating point), and what `apart(fn)` allocates (with
    the views of it: its storages are tracked as "apart")."""

    def __init__(self):
        super().__init__()
        self.live = {"device": 0, "host": 0, "apart": 0}
        self.peak = {"device": 0, "host": 0, "apart": 0}
        self._storages: dict[int, tuple[str, int, weakref.finalize]] = {}
        self._where = "device"

    @classmethod
    def apart(cls, fn):
        """fn, whose allocations no AllocationPeak counts (what a launch would not allocate)."""
        def not_counted(*args, **kwargs):
            cls._apart += 1
            try:
                return fn(*args, **kwargs)
            finally:
                cls._apart -= 1
        return not_counted

    _apart = 0  # > 0 while an `apart` function runs

    def host(self, fn):
        """fn, whose allocations count as host memory."""
        def on_host(*args, **kwargs):
            outer, self._where = self._where, "host"
            try:
                return fn(*args, **kwargs)
            finally:
                self._where = outer
        return on_host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs the operation on its local tensors, seen here
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type != "meta" \
                    and t.is_floating_point():
                self._count(t.untyped_storage())
        return out

    def _count(self, st: torch.UntypedStorage) -> None:
        key, nbytes = st._cdata, st.nbytes()
        known = self._storages.get(key)
        if known is not None:  # a view of it, or an in-place operation: resized?
            where, before, fin = known
            self._storages[key] = (where, nbytes, fin)
        else:
            where, before = "apart" if AllocationPeak._apart else self._where, 0
            self._storages[key] = (where, nbytes, weakref.finalize(st, self._free, key))
        self.live[where] += nbytes - before
        self.peak[where] = max(self.peak[where], self.live[where])

    def _free(self, key: int) -> None:
        where, nbytes, _ = self._storages.pop(key)
        self.live[where] -= nbytes

    def __exit__(self, *exc):
        for _, _, fin in self._storages.values():
            fin.detach()  # what outlives the measurement is no longer counted
        self._storages.clear()
        return super().__exit__(*exc)


# ----------------------------------------------------------------------------- wire and time


PLANNED_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "send-recv", "tp", "cp")  # the planner's Collective.kind


def planner_kind(call: Call, groups: dict[tuple[int, ...], str]) -> str:
    """The planner's collective kind of a measured call: `norm` for the gradient norm's reductions
    (not part of the planner's volumes), cp for context-parallel attention's (phase "cp":
    `cp_phase`), tp for anything on the tp group, send-recv for what a pipeline stage sends, the
    dp collectives by name (the project's gloo reduce-scatter is an all-to-all + a local sum:
    parallel/collectives.py), the tied embedding's all-reduce, the gradient all-reduce over cp; a
    call on any other group is named with it ("KIND on another group"). `groups`: the ranks of
    this rank's groups -> their name (tools/fake_world.py group_names). The phase, not the group,
    tells cp attention apart: at dp 1 the dp x cp group of the engine has the cp group's ranks."""
    if call.phase in ("norm", "cp"):
        return call.phase
    group = groups.get(call.ranks, "other")
    if group == "tp":
        return "tp"
    if call.kind in ("send", "recv"):
        return "send-recv" if call.kind == "send" else "recv"
    if call.kind == "all-to-all" and group in ("dp", "cp"):
        return "reduce-scatter"
    return call.kind if group in ("dp", "tied", "pp", "cp") else f"{call.kind} on another group"


@contextlib.contextmanager
def norm_phase(strategy, counter: "CollectiveCounter"):
    """While entered, the collectives of strategy.clip_grad_norm_ are counted in phase "norm"."""
    clip, own = strategy.clip_grad_norm_, "clip_grad_norm_" in vars(strategy)

    def tagged(max_norm):
        counter.phase = "norm"
        try:
            return clip(max_norm)
        finally:
            counter.phase = ""
    strategy.clip_grad_norm_ = tagged
    try:
        yield
    finally:
        if own:
            strategy.clip_grad_norm_ = clip
        else:
            del strategy.clip_grad_norm_  # the class's method again


@contextlib.contextmanager
def cp_phase(counter: "CollectiveCounter"):
    """While entered, what context-parallel attention sends is counted in phase "cp": every
    transfer of parallel/cp.py's Ring (the ring's shifts, allgather mode's gather and scatter)."""
    saved = {name: getattr(Ring, name) for name in ("start_shift", "all_gather", "reduce_scatter")}

    def tagged(fn):
        def in_phase(*args, **kwargs):
            outer, counter.phase = counter.phase, "cp"
            try:
                return fn(*args, **kwargs)
            finally:
                counter.phase = outer
        return in_phase
    for name, fn in saved.items():
        setattr(Ring, name, tagged(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(Ring, name, fn)


def loopback_tx_bytes() -> int:
    """Bytes `lo` has transmitted since boot (/proc/net/dev, Linux): every local rank's traffic."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise SystemExit("error: no loopback interface 'lo' in /proc/net/dev; this measurement needs Linux")


def add_timer(obj, name: str, clock: list[float]) -> None:
    """Wrap obj.name so its wall time is added to clock[0]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - t0
    setattr(obj, name, wrapper)


class StageClock:
    """Busy seconds of a parallel.pp.Pipeline on this rank: its stages' forward, backward and
    weight-backward chunks and the loss (the schedule's own compute; waits for peers excluded)."""

    def __init__(self, pipe):
        self.busy = [0.0]
        for stage in pipe.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                add_timer(stage, name, self.busy)
        add_timer(pipe.schedule, "_loss_fn", self.busy)
