"""optimizer.name=muon (parallel/muon.py): torch's Muon for the blocks' matrices, AdamW for the rest.

- which parameters each part steps, and the state each keeps;
- the update is torch.optim.Muon's, with the Newton-Schulz iterations in fp32 on a CPU (bit-exact
  against torch's Muon whose iteration is made fp32; in bf16 the iteration is torch's exactly);
- a resume through a snapshot is bit-identical to the uninterrupted run;
- ZeRO-1/2's flat slices and auto are refused with one line, and so are --plan and --dry-run
  (they model AdamW's state).
Parity with one process under ddp (2 ranks, and its state through DCP), fsdp (2 ranks), HSDP and
zero-3 with padded rows (4), a pipeline (pp 2, 1f1b), tp 2 and fsdp x tp (each matrix gathered):
tests/test_data_parallel.py and tests/test_tp_pp.py. Orthogonalising each rank's shard instead
of the gathered matrix fails that parity (measured at fsdp dp 2: loss 8.5e-4 relative, gradient
norm 2.7e-2, parameters 2.2e-3 apart after 6 steps).
"""
from __future__ import annotations

import pytest
import torch
import torch.optim._muon as torch_muon

import main as app
from checks import load_config
from config import UsageError
from harness import app_in_process, model_tensors
from parallel.muon import MUON_MODULES, Muon, MuonWithAdamW, orthogonalize
from parallel.options import problems
from testing.local import TINY
from testing.parity import build

MUON = ["optimizer.name=muon"]
COEFFICIENTS = (3.4445, -4.775, 2.0315)


def test_muon_steps_the_blocks_matrices_and_adamw_the_rest(tmp_path):
    trainer = build(["parallel.strategy=none", *MUON], tmp_path)
    opt = trainer.optimizer
    assert isinstance(opt, MuonWithAdamW)
    names = {id(p): n for n, p in trainer.strategy.unwrapped()[0].named_parameters()}
    on_muon = {names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    n_layer = trainer.cfg.model.n_layer
    assert len(on_muon) == 6 * n_layer and all(n.split(".")[-2] in MUON_MODULES for n in on_muon)
    on_adamw = {names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]}
    assert "tok_emb.weight" in on_adamw and "blocks.0.ln_1.weight" in on_adamw and not on_muon & on_adamw
    trainer.forward_backward()
    trainer.optimizer_step()
    params = dict(trainer.strategy.unwrapped()[0].named_parameters())
    assert set(opt.state[params["blocks.0.mlp.fc.weight"]]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq"} <= set(opt.state[params["tok_emb.weight"]])
    # the scheduler's lr reaches both parts: they step the optimizer's own group dicts
    for g in opt.param_groups:
        g["lr"] = 0.123
    assert {g["lr"] for g in opt._muon.param_groups + opt._adamw.param_groups} == {0.123}


def test_orthogonalize_in_bf16_is_torchs_newton_schulz():
    g = torch.randn(96, 32)
    ours = orthogonalize(g, COEFFICIENTS, 5, 1e-7, torch.bfloat16)
    assert torch.equal(ours, torch_muon._zeropower_via_newtonschulz(g, COEFFICIENTS, 5, 1e-7).float())


@pytest.mark.parametrize("shape", [(96, 32), (32, 96)])
def test_orthogonalize_in_fp32_maps_each_singular_value_by_the_quintic(shape):
    """A reference independent of both implementations: x <- a x + b (x x^T) x + c (x x^T)^2 x
    keeps g's singular vectors and maps each normalized singular value s to a s + b s^3 + c s^5,
    so 5 steps on g = U diag(s) V^T give U diag(f^5(s / |g|_F)) V^T (in float64, from an SVD)."""
    torch.manual_seed(0)
    g = torch.randn(*shape)
    u, sv, vt = torch.linalg.svd(g.double(), full_matrices=False)
    s, (a, b, c) = sv / g.double().norm(), COEFFICIENTS
    for _ in range(5):
        s = a * s + b * s**3 + c * s**5
    want = u @ torch.diag(s) @ vt
    ours = orthogonalize(g, COEFFICIENTS, 5, 1e-7, torch.float32)
    assert (ours.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_update_is_torchs_muon_with_fp32_newton_schulz(adjust, monkeypatch):
    torch.manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(48, 16)), torch.nn.Parameter(torch.randn(16, 64))]
    theirs_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn=adjust)
    ours, theirs = Muon(ours_p, **kwargs), torch.optim.Muon(theirs_p, **kwargs)
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda g, c, steps, eps: orthogonalize(g, c, steps, eps, torch.float32))
    for _ in range(3):
        grads = [torch.randn_like(p) for p in ours_p]
        for p, q, g in zip(ours_p, theirs_p, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, q in zip(ours_p, theirs_p):
        assert torch.equal(p, q)


def test_resume_is_bit_identical(tmp_path):
    train = app_in_process(TINY + MUON + ["parallel.strategy=none", "trainer.sample_tokens=0",
                                          "optimizer.lr_decay_steps=10"])
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert train(full, "trainer.max_steps=10", "trainer.save_every=5") == 0
    assert train(cut, "trainer.max_steps=5", "trainer.save_every=5") == 0
    assert train(cut, "trainer.max_steps=10", "trainer.save_every=5") == 0
    a, b = model_tensors(full), model_tensors(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("overrides, words", [
    (["parallel.strategy=zero", "parallel.zero_stage=1"], "ZeRO-1 keeps flat slices"),
    (["parallel.strategy=zero", "parallel.zero_stage=2"], "ZeRO-2 keeps flat slices"),
    (["parallel.strategy=auto"], "parallel.strategy=auto plans AdamW's state only"),
])
def test_flat_slices_and_auto_are_refused_dtensor_shards_are_gathered(overrides, words):
    """ZeRO-1/2 keep flat slices of plain tensors (no matrix to gather) and auto's planner has no
    Muon state: one line each. FSDP2 and tp hold DTensors, which Muon gathers per matrix (their
    parity with one process: tests/test_data_parallel.py and tests/test_tp_pp.py)."""
    with pytest.raises(UsageError) as refused:
        load_config(None, TINY + MUON + overrides)
    assert words in str(refused.value) and "optimizer.name=adamw" in str(refused.value)
    for fine in (["parallel.strategy=ddp", "parallel.pp=2"], ["parallel.strategy=fsdp"],
                 ["parallel.strategy=zero", "parallel.zero_stage=3"], ["parallel.strategy=fsdp", "parallel.tp=2"]):
        assert not list(problems(load_config(None, TINY + MUON + fine), 4)), fine


# --plan measures this machine before it refuses (tools/calibrate.py starts processes): the test session's
# cache of the figures (conftest) starts empty
@pytest.mark.parametrize("command", [pytest.param(["--plan", "--world-size", "4"], marks=pytest.mark.launch),
                                     ["--dry-run", "--world-size", "4"]])
def test_plan_and_dry_run_refuse_what_they_do_not_model(command, capsys):
    assert app.main([*command, *TINY, *MUON]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the planner models AdamW's state" in err, err
