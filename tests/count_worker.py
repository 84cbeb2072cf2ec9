"""Run under torchrun by tests/test_strategy_report.py: collectives of known size through
measure.CollectiveCounter and the loopback counter.

Every rank issues, inside one CollectiveCounter, each kind of collective the strategies use on a
tensor of K = 4 * ELEMS bytes, and rank 0 writes OUT/counted.json: the calls (kind, op, group size,
payload) and, for an all-reduce and an all-gather of K, the bytes `lo` transmitted (all ranks
together, between two barriers).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from harness import run_worker
from parallel.collectives import reduce_scatter
from tools.measure import CollectiveCounter, loopback_tx_bytes

ELEMS = 2**18  # 1 MiB of fp32


def wire(fn) -> int:
    dist.barrier()
    before = loopback_tx_bytes()
    fn()
    dist.barrier()
    return loopback_tx_bytes() - before


def body(args) -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    x = torch.ones(ELEMS)
    solo = dist.new_group([0])  # a sub-group: the counter must name its ranks, not the world's
    with CollectiveCounter() as counter:
        dist.all_reduce(x.clone())
        reduce_scatter(torch.empty(ELEMS // n), x.clone(), None)  # the project's: an all-to-all on gloo
        dist.reduce_scatter_tensor(torch.empty(ELEMS // n), x.clone())
        dist.all_gather_into_tensor(torch.empty(ELEMS), x[: ELEMS // n].clone())
        funcol.wait_tensor(funcol.all_reduce(x.clone(), "sum", dist.group.WORLD))
        if rank == 0:
            dist.send(x[:1000].clone(), 1)
        elif rank == 1:
            dist.recv(torch.empty(1000), 0)
        if rank == 0:
            dist.all_reduce(x[:10].clone(), group=solo)
        # DTensor: Shard(0) -> Replicate is one all-gather of the whole tensor, issued by DTensor
        DTensor.from_local(x[: ELEMS // n].clone(), mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
    bytes_on_lo = {"all-reduce": wire(lambda: dist.all_reduce(x.clone())),
                   "all-gather": wire(lambda: dist.all_gather_into_tensor(torch.empty(ELEMS),
                                                                          x[: ELEMS // n].clone()))}
    if rank == 0:
        calls = [asdict(c) | {"group_size": len(c.ranks)} for c in counter.calls]
        (args.out / "counted.json").write_text(json.dumps({"calls": calls, "lo": bytes_on_lo, "n": n}))


if __name__ == "__main__":
    run_worker(body)
    # Leave without interpreter finalization: once in CI a rank aborted there ("terminate called
    # without an active exception", SIGABRT) after this point; gloo's worker threads can still hold
    # work objects of the asynchronous collectives above while Python tears down (the failure
    # pytorch#179291 describes). Everything this worker measures is written by now.
    sys.stdout.flush()
    os._exit(0)
