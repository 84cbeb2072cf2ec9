"""parallel.strategy=dp: torch's nn.DataParallel, one process driving every visible GPU.

Each forward scatters the (micro-)batch along dim 0 over the GPUs, replicates the module onto
each of them, runs the replicas in threads and gathers the logits on the first GPU, where the
loss is computed; backward sums the replicas' gradients into the first GPU's parameters. Memory
on the first GPU is that of plain training plus the gathered outputs; the replicas are rebuilt on
every forward (which is why DDP, one process per GPU, is faster).

It is a single-process strategy: under torchrun with more than one process the layout check
refuses it (use ddp).
With fewer than two GPUs it runs as plain one-process training and says so once. The Trainer
only sees the inner module through `unwrapped()`, so snapshots and model.pt use the GPT's own
parameter names ("blocks.0.attn.q_proj.weight", not "module.blocks...").
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from config import Config
from parallel.step import autocast
from parallel.strategy import Strategy


class AutocastForward(nn.Module):
    """`module` whose forward enters the run's autocast itself. nn.DataParallel runs every replica
    in a thread of its own and re-enters autocast there with `enabled` only
    (torch/nn/parallel/parallel_apply.py); autocast's dtype is thread-local, so the replicas would
    compute in the device's default dtype (fp16 on CUDA) in a bf16 run. torch's AMP notes
    prescribe this for DataParallel: autocast inside the model's forward
    (https://pytorch.org/docs/stable/notes/amp_examples.html#dataparallel-in-a-single-process)."""

    def __init__(self, module: nn.Module, cfg: Config, device: torch.device):
        super().__init__()
        self.module, self.cfg, self.device = module, cfg, device

    def forward(self, *args, **kwargs):
        with autocast(self.cfg, self.device):
            return self.module(*args, **kwargs)


class DataParallelStrategy(Strategy):
    name = "dp"

    @property
    def gpu_ids(self) -> list[int]:
        return list(range(torch.cuda.device_count())) if self.device.type == "cuda" else []

    @property
    def rng_gpus(self) -> list[int]:
        """nn.DataParallel's replicas draw their dropout masks from the generator of the GPU each runs on."""
        return self.gpu_ids if len(self.gpu_ids) >= 2 else super().rng_gpus

    @property
    def num_devices(self) -> int:
        """Every GPU that nn.DataParallel splits the batch over (it is used from 2 GPUs on)."""
        ids = self.gpu_ids
        return len(ids) if len(ids) >= 2 else 1

    def describe_dp(self) -> str:
        ids = self.gpu_ids
        if len(ids) < 2:
            return f"dp (one device, {self.device}: plain one-process training)"
        return f"dp (nn.DataParallel over GPUs {','.join(map(str, ids))})"

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        ids = self.gpu_ids
        if len(ids) < 2:
            warnings.warn(f"parallel.strategy=dp found {len(ids)} GPU(s): training as one process on "
                          f"{self.device} (nn.DataParallel needs 2+ GPUs to split the batch)", stacklevel=2)
            return model
        # The parameters must live on device_ids[0] = the current device (pick_device set it).
        replicated = nn.DataParallel(AutocastForward(model, self.cfg, self.device), device_ids=ids, output_device=ids[0])
        if not self.cfg.trainer.compile:
            return replicated
        # parallelize compiled each block in place, but nn.DataParallel's replicas copy a block's
        # __dict__, and with it the compiled call bound to the block on GPU 0: the replica on GPU 1
        # would run GPU 0's weights. So here the blocks run eager and the whole wrapper is compiled.
        for block in model.blocks.values():
            block._compiled_call_impl = None
        return torch.compile(replicated)
