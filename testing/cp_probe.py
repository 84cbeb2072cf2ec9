"""Context parallelism on one device: `python -m torch.distributed.run --nproc_per_node=N -m
testing.cp_probe [--math-kernels]` runs parallel.cp's ring and all-gather attention over N processes that share one
device (a GPU: scripts/gpu_check.py runs it there), and prints one line `cp-probe: {json}`.

Each process builds the same 2-layer GPT, puts it over the cp ranks with the product's own
`apply_context_parallel` (so the device's block kernels run: plain matmuls on CUDA, the fused CPU
kernel on the CPU) and compares the mean of the ranks' losses and gradients with one model's on the
whole sequences. The ranks talk over gloo through host copies (`HostRing`): NCCL refuses two ranks
on one GPU, so the collectives' device path is not what this proves; the attention's is."""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from model import GPT, GPTConfig, lm_loss
from parallel import cp as cpmod

WIDTH, HEADS, LAYERS, VOCAB, BATCH = 64, 4, 2, 64, 4
# (loss gap, gradient gap) allowed: fp32 sums the same terms in another order (measured: at most
# 5e-7 on the CPU and on an H200, cp 2 and 4); bf16 rounds the attention's inputs and the one
# model's fused kernel differently (at most 7e-5 and 7.6e-3 on the H200, 6e-5 and 4.4e-3 on the CPU).
# A block missed or counted twice moves both by 1e-2 or more: fp32 tells it, bf16 at about 2x its noise.
BOUNDS = {"fp32": (1e-5, 1e-5), "bf16": (5e-3, 1.5e-2)}


class HostRing(cpmod.Ring):
    """cp.Ring over a gloo group for tensors on any device: each call goes through host copies."""

    def all_gather(self, t):
        return super().all_gather(t.cpu()).to(t.device)

    def reduce_scatter(self, t):
        return super().reduce_scatter(t.cpu()).to(t.device)

    def start_shift(self, tensors, tag):
        wait = super().start_shift([t.cpu() for t in tensors], tag)
        return lambda: [r.to(tensors[0].device) for r in wait()]


def cp_parity(device: torch.device, mode: str, dtype: torch.dtype) -> tuple[float, float]:
    """(|mean of the ranks' losses - one model's loss|, max |mean of the ranks' gradients - one
    model's| over every gradient element / the model's largest gradient element), under autocast to
    `dtype` unless fp32; every rank returns the same figures. (Per parameter would divide by zero:
    a key bias's gradient is 0 in exact arithmetic, softmax being blind to a shift of every score.)"""
    cp, rank = dist.get_world_size(), dist.get_rank()
    block = 16 * cp
    torch.manual_seed(4)  # every rank: the same model and tokens
    one = GPT(GPTConfig(vocab_size=VOCAB, block_size=block, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, dropout=0.0),
              seed=3).to(device)
    x, y = (torch.randint(0, VOCAB, (BATCH, block), device=device) for _ in range(2))
    mine = copy.deepcopy(one)
    cpmod.apply_context_parallel(mine, HostRing(dist.group.WORLD), mode)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        ref = lm_loss(one(x), y)
        loss = lm_loss(mine(cpmod.shard_sequence(x, rank, cp)), cpmod.shard_sequence(y, rank, cp))
    ref.backward()
    loss.backward()
    mean = torch.cat([loss.detach().float().reshape(1).cpu()] + [p.grad.reshape(-1).cpu() for p in mine.parameters()])
    dist.all_reduce(mean)
    mean /= cp
    ref_grads = torch.cat([p.grad.reshape(-1).float().cpu() for p in one.parameters()])
    grad_gap = float((mean[1:] - ref_grads).abs().max() / ref_grads.abs().max())
    return abs(float(mean[0]) - ref.item()), grad_gap


def main() -> None:
    if sys.argv[1:] == ["--math-kernels"]:  # the GPU's block kernels on any device (tests/test_gpu_paths.py)
        cpmod.kernels = lambda device: (cpmod.math_block, cpmod.math_block_backward)
    dist.init_process_group("gloo")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    figures = {f"{mode} {name}": cp_parity(device, mode, dtypes[name]) for mode in cpmod.ATTENTION for name in BOUNDS}
    if dist.get_rank() == 0:
        kernel = cpmod.kernels(device)[0].__name__
        within = all(loss < BOUNDS[k.split()[1]][0] and grad < BOUNDS[k.split()[1]][1] for k, (loss, grad) in figures.items())
        summary = (f"cp {dist.get_world_size()}, {kernel} on {device}, loss/gradient gaps: "
                   + ", ".join(f"{k} {loss:.1e}/{grad:.1e}" for k, (loss, grad) in figures.items()))
        print("cp-probe: " + json.dumps({"device": str(device), "within_bounds": within, "summary": summary,
                                         "figures": figures}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
