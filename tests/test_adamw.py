"""parallel/adamw.py: AdamW fused per kind of parameter, for tensor parallelism's mix of DTensors
and plain tensors, in this process on rank 0 of a 2-rank fake process group (the tp model's own
DTensors; the step is element-wise, so no collective is needed and none runs)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.testing._internal.distributed.fake_pg import FakeStore

from checks import load_config
from model import GPT, GPTConfig
from parallel.adamw import MeshwiseAdamW
from parallel.strategy import Strategy, fusable
from parallel.tp import apply_tensor_parallel


@pytest.fixture
def tp_model():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        yield apply_tensor_parallel(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16),
                                        seed=5), mesh, vocab_parallel=True)
    finally:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def test_meshwise_adamw_steps_a_tensor_parallel_mix_as_torchs_default_adamw(tp_model):
    groups = lambda m: [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},  # noqa: E731
                        {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    other = copy.deepcopy(tp_model)
    before = [_local(p).clone() for p in tp_model.parameters()]
    kinds = {type(p) for p in tp_model.parameters()}
    assert DTensor in kinds and torch.nn.Parameter in kinds and not fusable(groups(tp_model))  # the mix
    ours, torchs = MeshwiseAdamW(groups(tp_model), lr=1e-2), torch.optim.AdamW(groups(other), lr=1e-2)
    for step in range(3):
        for model in (tp_model, other):
            torch.manual_seed(step)  # the same gradients for both: a DTensor's local shard, or a plain tensor
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            # a vocabulary-parallel embedding's gradient comes back Replicate beside its Shard(0)
            # weight (parallel/dtensor.py grad_like_param): the kernel gets it laid out like the weight
            emb = model.tok_emb.weight
            assert isinstance(emb, DTensor) and emb.placements != (Replicate(),)
            whole = torch.randn(emb.shape)  # every rank's copy (no collective: the fake group fills nothing)
            emb.grad = DTensor.from_local(whole, emb.device_mesh, (Replicate(),), run_check=False)
        ours.step()
        torchs.step()
    for (name, a), b, start in zip(tp_model.named_parameters(), other.parameters(), before):
        assert (_local(a) - _local(b)).abs().max() <= 1e-6 * _local(b).abs().max(), name
        assert (_local(a) - start).abs().max() > 1e-3, name  # every kind was stepped
    # the same state dict as torch's (snapshots and DCP see an AdamW), but for the kernel flag
    mine, theirs = ours.state_dict(), torchs.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    assert all(mine["state"][i].keys() == theirs["state"][i].keys() for i in mine["state"])
    strip = lambda g: {k: v for k, v in g.items() if k not in ("fused", "foreach")}  # noqa: E731
    assert [strip(g) for g in mine["param_groups"]] == [strip(g) for g in theirs["param_groups"]]


def test_torchs_fused_adamw_refuses_the_mix_that_meshwise_adamw_steps(tp_model):
    for p in tp_model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(Exception):
        torch.optim.AdamW(tp_model.parameters(), lr=1e-2, fused=True).step()
    MeshwiseAdamW(tp_model.parameters(), lr=1e-2).step()


def test_the_strategy_takes_meshwise_adamw_for_a_mix_and_torchs_fused_one_for_one_kind(tp_model):
    """parallel/strategy.py Strategy.adamw: the tp model's mix steps in MeshwiseAdamW; a model of
    plain tensors in torch's own fused AdamW (its state dict and kernel as before)."""
    host = SimpleNamespace(cfg=load_config(None, []))  # adamw reads the optimizer's config only
    assert type(Strategy.adamw(host, [{"params": list(tp_model.parameters())}])) is MeshwiseAdamW
    plain = Strategy.adamw(host, [{"params": list(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2,
                                                                n_embd=8)).parameters())}])
    assert type(plain) is torch.optim.AdamW and plain.defaults["fused"] is True
