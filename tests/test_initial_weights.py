"""Every layout starts from exactly the weights one process starts from (model.initial_tensor: each
parameter from a generator seeded with (trainer.seed, its name); parallel/materialize.py fills each
rank's share of a model built on the meta device): gathered and compared bit for bit, and the tied
head stays tied after the meta model is allocated."""
from __future__ import annotations

import json

import pytest
import torch

from model import GPT, GPTConfig, initial_tensor
from testing.local import torchrun
from testing.parity import build

WORLD4 = {
    "ddp dp4": "parallel.strategy=ddp",
    "zero-1 dp4": "parallel.strategy=zero parallel.zero_stage=1",
    "zero-2 dp4": "parallel.strategy=zero parallel.zero_stage=2",
    "zero-3 dp4": "parallel.strategy=zero parallel.zero_stage=3",
    "fsdp dp4": "parallel.strategy=fsdp",
    "hsdp 2x2": "parallel.strategy=fsdp parallel.dp_replicate=2",
    "pp2 x tp2": "parallel.strategy=none parallel.pp=2 parallel.tp=2",
    "tp4 vocab-parallel": "parallel.tp=4 parallel.tp_vocab_parallel=true",
    "pp2 x dp2": "parallel.strategy=ddp parallel.pp=2",
    "fsdp x tp": "parallel.strategy=fsdp parallel.tp=2",
}
WORLD8 = {"mesh 2x2x2 (pp x fsdp x tp)": "parallel.strategy=fsdp parallel.pp=2 parallel.tp=2",
          # 65 vocabulary rows: 33 and 32 per tp rank, then FSDP2's chunks of those over dp 4 (9, 9, 9, 6
          # and 8 x 4): materialize's own cut (local_piece) against FSDP2's chunks
          "fsdp dp4 x tp2 vocab-parallel (uneven)": "parallel.strategy=fsdp parallel.tp=2 parallel.tp_vocab_parallel=true"}


def test_one_process_builds_the_model_on_meta_and_keeps_the_tied_head_tied(tmp_path):
    """The launch's own path in one process: the meta model, allocated and filled, is
    GPT(cfg, seed)'s model, and the head is the token embedding (to_empty allocates each module's
    attribute apart: materialize ties them again; untied, they would train apart)."""
    trainer = build(["parallel.strategy=none"], tmp_path / "run")
    model = trainer.strategy.unwrapped()[0]
    assert model.lm_head.weight is model.tok_emb.weight
    one = GPT(GPTConfig(**trainer.model_config), seed=trainer.cfg.trainer.seed).state_dict()
    # on the device the session runs on (a GPU too): the same values as the CPU's GPT(cfg, seed)
    assert all(torch.equal(v.cpu(), one[k]) for k, v in model.state_dict().items())
    other_seed = build(["parallel.strategy=none", "trainer.seed=7"], tmp_path / "seed7").strategy.unwrapped()[0]
    assert not torch.equal(other_seed.tok_emb.weight.cpu(), model.tok_emb.weight.cpu())


def test_initial_values_depend_on_the_seed_and_name_only():
    """The same tensor in any process, whatever was drawn before; another name, another tensor."""
    cfg = GPTConfig(vocab_size=65, block_size=8, n_layer=2, n_head=2, n_embd=16)
    with torch.device("meta"):
        model = GPT(cfg)
    torch.manual_seed(123)
    a = initial_tensor(model, "blocks.0.attn.q_proj.weight", 1337)
    torch.randn(100)
    assert torch.equal(a, initial_tensor(model, "blocks.0.attn.q_proj.weight", 1337))
    assert not torch.equal(a, initial_tensor(model, "blocks.0.attn.k_proj.weight", 1337))
    assert torch.equal(initial_tensor(model, "lm_head.weight", 1337), initial_tensor(model, "tok_emb.weight", 1337))
    assert float(initial_tensor(model, "blocks.1.mlp.proj.weight", 1337).std()) < 0.02 / 1.5  # 0.02 / sqrt(2 L)


@pytest.mark.launch
@pytest.mark.parametrize("world, cases", [(4, WORLD4), (8, WORLD8)])
def test_every_layout_starts_from_one_process_initial_weights_bit_for_bit(tmp_path, world, cases):
    args = [arg for name, overrides in cases.items() for arg in ("--case", name, overrides)]
    r = torchrun(world, ["tests/init_worker.py", "--out", str(tmp_path), *args], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "initial.json").read_text())
    assert set(report) == set(cases)
    assert report == {name: [] for name in cases}, report
