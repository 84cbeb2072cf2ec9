"""The data-parallel family (dp, ddp, zero stages 1/2/3, fsdp) against one process.

- parity with one process (testing/parity.py: first-step gradients <= 1e-6 abs, loss <= 1e-4 rel
  and gradient norm <= 1e-5 rel at each of 6 steps, parameters after the first and the last
  step <= 1e-5 abs; bf16/fp16: norm and parameters after the first step) at dp=2 (TINY:
  accumulation 2) and dp=4, incl. bucket/option variants, activation checkpointing (zero-1,
  zero-2, fsdp), bf16 autocast and fp16 loss scaling (ddp, zero, fsdp); a deliberately wrong
  clipping norm fails it;
- per-rank resident bytes (read from the local tensors) against the ZeRO formulas;
- state dicts: written by zero/fsdp, loaded into another strategy and world size, bit-exact;
- the whole app (main.main) for every strategy: trains, evaluates (val loss averaged over dp
  ranks = one process's), writes model.pt, one process prints and logs; a zero-2 snapshot
  resumed by fsdp ends where uninterrupted training does;
- bad input: one line, exit code 2.
Launches: one 2-process + one 4-process tests/dp_worker.py, one 2-process tests/app_worker.py,
one single-process `python main.py parallel.strategy=dp`; everything else runs in this process.
nn.DataParallel itself (2+ GPUs) runs in no CPU test: on the CPU, strategy=dp is plain training.
"""
from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

import main as app
from checks import load_config
from config import UsageError
from harness import metric_rows, model_tensors
from parallel.fsdp import FSDPStrategy
from parallel.layout import Layout
from parallel.strategy import Strategy
from parallel.zero import Zero3Strategy
from testing.local import DEVICE, TINY, python, torchrun
from testing.parity import (
    FP16_SCALE,
    LOSS_RTOL,
    MIN_STEPS,
    NORM_RTOL,
    PARAM_ATOL,
    assert_parity,
    build,
    load_case,
    parity_errors,
    run_steps,
)

STEPS = MIN_STEPS  # the fewest the parity check accepts: the fixtures train ~30 cases
ZERO = "parallel.strategy=zero parallel.zero_stage="
ODD = "model.n_embd=30 model.n_head=2"  # no tensor size divides by 4: exercises shard padding

# name -> (overrides, reference). References are single-process runs of the same model/precision.
# zero-3 is FSDP2 with fsdp's defaults (test_zero3_is_fsdp_with_its_defaults): fsdp's cases are its
# cases, and only a combination fsdp lacks (Muon on odd sizes) runs as zero-3.
TWO_PROC = {
    "ddp": ("parallel.strategy=ddp", "fp32"),
    "ddp_options": ("parallel.strategy=ddp parallel.bucket_cap_mb=0.01 parallel.gradient_as_bucket_view=false",
                    "fp32"),
    "ddp_static": ("parallel.strategy=ddp parallel.static_graph=true trainer.micro_batch_size=4", "fp32"),
    "zero1": (ZERO + "1", "fp32"),
    "zero1_buckets": (ZERO + "1 parallel.bucket_cap_mb=0.01", "fp32"),
    "zero2": (ZERO + "2", "fp32"),
    "zero2_buckets": (ZERO + "2 parallel.bucket_cap_mb=0.01", "fp32"),
    "zero1_ckpt_act": (ZERO + "1 parallel.activation_checkpointing=true", "fp32"),
    "zero2_ckpt_act": (ZERO + "2 parallel.activation_checkpointing=true", "fp32"),
    "fsdp": ("parallel.strategy=fsdp", "fp32"),
    "fsdp_keep_gathered": ("parallel.strategy=fsdp parallel.reshard_after_forward=false", "fp32"),
    "fsdp_cpu_offload": ("parallel.strategy=fsdp parallel.cpu_offload=true", "fp32"),
    "fsdp_ckpt_act": ("parallel.strategy=fsdp parallel.activation_checkpointing=true", "fp32"),
    "ddp_bf16": ("parallel.strategy=ddp trainer.precision=bf16", "bf16"),
    "ddp_fp16": ("parallel.strategy=ddp trainer.precision=fp16", "fp16"),
    "zero2_bf16": (ZERO + "2 trainer.precision=bf16", "bf16"),
    "fsdp_bf16": ("parallel.strategy=fsdp trainer.precision=bf16", "bf16"),
    "zero1_fp16": (ZERO + "1 trainer.precision=fp16", "fp16"),
    "zero2_fp16": (ZERO + "2 trainer.precision=fp16", "fp16"),
    "fsdp_fp16": ("parallel.strategy=fsdp trainer.precision=fp16", "fp16"),
    "ddp_muon": ("parallel.strategy=ddp optimizer.name=muon", "muon"),
    "fsdp_muon": ("parallel.strategy=fsdp optimizer.name=muon", "muon"),  # each matrix gathered for Muon
}
FOUR_PROC = {
    "ddp": ("parallel.strategy=ddp", "fp32"),
    "zero1": (ZERO + "1", "fp32"),
    "zero2": (ZERO + "2", "fp32"),
    "fsdp": ("parallel.strategy=fsdp", "fp32"),
    "zero1_odd": (f"{ZERO}1 {ODD}", "odd"),
    "zero2_odd": (f"{ZERO}2 {ODD}", "odd"),
    "fsdp_odd": (f"parallel.strategy=fsdp {ODD}", "odd"),
    "hsdp": ("parallel.strategy=fsdp parallel.dp_replicate=2", "fp32"),  # 2 replicas x 2 shards
    # Muon's gather on a 2-D mesh, and of padded FSDP2 rows (no size divides by 4)
    "hsdp_muon": ("parallel.strategy=fsdp parallel.dp_replicate=2 optimizer.name=muon", "muon"),
    "zero3_muon_odd": (f"{ZERO}3 {ODD} optimizer.name=muon", "odd_muon"),
}
REFERENCES = {"fp32": "", "bf16": "trainer.precision=bf16", "fp16": "trainer.precision=fp16", "odd": ODD,
              "muon": "optimizer.name=muon", "odd_muon": f"{ODD} optimizer.name=muon"}
# FSDP2 compute in bf16 (sharded fp32 master weights): not bit-comparable with fp32 training.
MIXED = ("fsdp_mixed_bf16", "parallel.strategy=fsdp parallel.mixed_precision=bf16")
MIXED_LOSS_RTOL = 2e-2

MUON = "parallel.strategy=ddp optimizer.name=muon"
SAVE = {"zero2": ZERO + "2", "fsdp": "parallel.strategy=fsdp", "ddp_muon": MUON,
        "fsdp_muon": "parallel.strategy=fsdp optimizer.name=muon"}
LOAD_TWO = [("fsdp", "zero1_from_fsdp", ZERO + "1"), ("zero2", "fsdp_from_zero2", "parallel.strategy=fsdp"),
            ("ddp_muon", "ddp_muon_reloaded", MUON),  # Muon's momentum + AdamW's moments through DCP
            ("fsdp_muon", "ddp_muon_from_fsdp", MUON)]  # sharded Muon momentum loaded whole
LOAD_FOUR = [("zero2", "zero1_from_zero2", ZERO + "1"), ("zero2", "fsdp_from_zero2", "parallel.strategy=fsdp"),
             ("fsdp", "zero2_from_fsdp", ZERO + "2"),
             ("fsdp", "hsdp_from_fsdp", "parallel.strategy=fsdp parallel.dp_replicate=2")]


def worker_args(cases: dict, extra: list[str]) -> list[str]:
    args = []
    for name, (overrides, _) in cases.items():
        args += ["--case", name, overrides]
    return args + extra


def launch(nproc: int, out: Path, args: list[str]) -> Path:
    r = torchrun(nproc, ["tests/dp_worker.py", "--out", str(out), "--steps", str(STEPS), *args])
    assert r.returncode == 0, "\n".join(
        [l for l in r.stderr.splitlines() if "Error" in l or "error" in l][:20]) + r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ref")
    return {name: run_steps(["parallel.strategy=none", *extra.split()], STEPS, root / name)
            for name, extra in REFERENCES.items()}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    extra = ["--case", *MIXED]
    for name, overrides in SAVE.items():
        extra += ["--save", name, overrides]
    for ckpt, name, overrides in LOAD_TWO:
        extra += ["--load", ckpt, name, overrides]
    return launch(2, tmp_path_factory.mktemp("dp2"), worker_args(TWO_PROC, extra))


@pytest.fixture(scope="module")
def four(tmp_path_factory, two) -> Path:
    extra = ["--buckets"]
    for ckpt, name, overrides in LOAD_FOUR:
        extra += ["--load", str(two / f"ckpt-{ckpt}"), name, overrides]
    return launch(4, tmp_path_factory.mktemp("dp4"), worker_args(FOUR_PROC, extra))


def check_parity(ref: dict, got: dict, name: str, reference: str) -> None:
    # fp16: compare true gradients: both runs scaled the loss by FP16_SCALE
    assert_parity(ref, got, name, grad_scale=FP16_SCALE if reference == "fp16" else 1.0,
                  low_precision=reference in ("bf16", "fp16"))


# ----------------------------------------------------------------------------- parity


@pytest.mark.launch
def test_parity_two_processes(references, two):
    for name, (_, reference) in TWO_PROC.items():
        got = load_case(two, name)
        assert got["dp"] == 2
        check_parity(references[reference], got, f"{name} (dp=2)", reference)


@pytest.mark.launch
def test_parity_four_processes(references, four):
    for name, (_, reference) in FOUR_PROC.items():
        got = load_case(four, name)
        assert got["dp"] == 4
        check_parity(references[reference], got, f"{name} (dp=4)", reference)


@pytest.mark.launch
def test_fsdp_mixed_precision_trains_close_to_fp32(references, two):
    ref, got = references["fp32"], load_case(two, MIXED[0])
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(a - b) <= MIXED_LOSS_RTOL * a, f"bf16 params: loss at step {step}: {b} vs fp32 {a}"
    assert got["losses"][-1] < got["losses"][0]


def test_zero3_is_fsdp_with_its_defaults():
    """Why zero-3 has no parity cases of its own: its class changes nothing of FSDPStrategy's work but
    its name, its start-up words and resharding after forward, which fsdp does by default. A zero-3
    that starts to differ fails here, and wants its cases back in TWO_PROC and FOUR_PROC."""
    assert Zero3Strategy.__bases__ == (FSDPStrategy,)
    assert {k for k in vars(Zero3Strategy) if not k.startswith("__")} == {"name", "reshard_after_forward",
                                                                           "describe_dp"}
    assert load_config(None, ["parallel.strategy=fsdp"]).parallel.reshard_after_forward is True


def test_nn_dataparallel_matches_one_process(references, tmp_path):
    """parallel.strategy=dp against one process, on whatever the session runs on. With 2+ GPUs (a
    MINGPT_TEST_DEVICE=cuda session on a multi-GPU machine: scripts/gpu_check.sh selects this test
    by name) the model is wrapped in nn.DataParallel, which splits each micro-batch over the GPUs
    and sums their gradients, and must train as one process does. With fewer (every CPU run) it is
    left unwrapped, says so, and trains as one process does: on the CPU this proves the fallback
    only, and nn.DataParallel itself stays unproven until a multi-GPU session runs it
    (docs/correctness.md)."""
    gpus = torch.cuda.device_count() if DEVICE == "cuda" else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_steps(["parallel.strategy=dp"], STEPS, tmp_path / "dp")
        strategy = build(["parallel.strategy=dp"], tmp_path / "built").strategy
    said = [str(w.message) for w in caught if "parallel.strategy=dp found" in str(w.message)]
    wrapped = isinstance(strategy.runner.wrapped, torch.nn.DataParallel)
    if gpus >= 2:
        assert wrapped and strategy.num_devices == gpus and not said, (wrapped, said)
        assert f"nn.DataParallel over GPUs {','.join(map(str, range(gpus)))}" in strategy.describe_dp()
    else:
        assert not wrapped and strategy.num_devices == 1, strategy.runner.wrapped
        assert said and f"found {gpus} GPU(s): training as one process" in said[0], said
        assert "plain one-process training" in strategy.describe_dp()
    assert_parity(references["fp32"], got, f"dp ({gpus} GPUs{'' if gpus >= 2 else ': one process'})")


def _norm_missing_a_shard(strategy, max_norm: float) -> torch.Tensor:
    """A broken clip: the norm counts only the first of two dim-0 shards of every gradient (as
    FSDP shards them over 2 ranks), as if one rank's shards were left out; it clips with that."""
    params = [p for p in strategy.unwrapped()[0].parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad.chunk(2)[0] for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def test_parity_catches_a_wrong_norm(references, tmp_path, monkeypatch):
    """The loss alone barely sees a wrong clipping norm (AdamW is nearly scale-invariant); the
    norm check at every step and the parameter check do."""
    ref = references["fp32"]
    scaled = {**ref, "grad_norms": [n * math.sqrt(2) for n in ref["grad_norms"]]}
    with pytest.raises(AssertionError, match="gradient norm at step 0"):
        assert_parity(ref, scaled, "norms scaled by sqrt(2)")
    params = {k: v.clone() for k, v in ref["params"].items()}
    params["lm_head.weight"][3, 5] += 2 * PARAM_ATOL
    with pytest.raises(AssertionError, match="parameter lm_head.weight after the last step"):
        assert_parity(ref, {**ref, "params": params}, "one parameter off")
    # a real run whose clipping norm leaves half of the gradients uncounted
    monkeypatch.setattr(Strategy, "clip_grad_norm_", _norm_missing_a_shard)
    broken = run_steps(["parallel.strategy=none"], STEPS, tmp_path)
    assert parity_errors(ref, broken)["norm_rel"] > 0.2  # measured 0.36 at the first step
    with pytest.raises(AssertionError, match="gradient norm at step 0"):
        assert_parity(ref, broken, "norm missing a shard")


# ----------------------------------------------------------------------------- memory


def shard_slack(model_overrides: str, n: int) -> tuple[int, int]:
    """(T, R): unique parameter tensors and the sum of their dim-0 row sizes. Element sharding
    pads < 1 element per tensor per rank (bound: T elements); FSDP2's dim-0 sharding pads < 1
    row per tensor per rank (bound: R elements)."""
    from model import GPT, GPTConfig
    m = dict(kv.split("=") for kv in f"{' '.join(TINY)} {model_overrides}".split() if kv.startswith("model."))
    cfg = GPTConfig(vocab_size=65, **{k.split(".")[1]: int(v) for k, v in m.items()})
    params = {id(p): p for p in GPT(cfg).parameters()}.values()
    return len(params), sum(p.numel() // p.shape[0] for p in params)


def check_memory(result: dict, kind: str, model_overrides: str = "") -> None:
    """Per-rank bytes vs the seed formulas for fp32 AdamW with a parameters on n ranks."""
    a, n = result["num_params"], result["dp"]
    T, R = shard_slack(model_overrides, n)
    formulas = {  # category -> (expected bytes, allowed padding bytes)
        "ddp": {"params": (4 * a, 0), "grads": (4 * a, 0), "optimizer": (8 * a, 0)},
        "zero1": {"params": (4 * a, 0), "grads": (4 * a, 0), "optimizer": (8 * a / n, 8 * T)},
        "zero2": {"params": (4 * a, 0), "grads": (4 * a / n, 4 * T), "optimizer": (8 * a / n, 8 * T)},
        "sharded3": {"params": (4 * a / n, 4 * R), "grads": (4 * a / n, 4 * R), "optimizer": (8 * a / n, 8 * R)},
    }[kind]
    assert len(result["memory"]) == n
    for rank, mem in enumerate(result["memory"]):
        for cat, (want, slack) in formulas.items():
            # Padding adds at most one element (row) per tensor to a rank; the last ranks' clipped
            # chunks may hold up to n-1 fewer (chunk = ceil(size / n)).
            assert want - (n - 1) * slack <= mem[cat] <= want + slack, (
                f"{kind} rank {rank} {cat}: {mem[cat]} bytes, formula {want:.0f} (+{slack}) with a={a}, n={n}")
    if kind != "ddp":  # sharded optimizer state: no element held twice, none missing
        assert sum(m["optimizer"] for m in result["memory"]) == 8 * a


@pytest.mark.launch
def test_memory_follows_formulas(two, four):
    for name, kind in [("ddp", "ddp"), ("zero1", "zero1"), ("zero2", "zero2"), ("fsdp", "sharded3")]:
        check_memory(load_case(two, name), kind)
    for name, kind in [("zero1", "zero1"), ("zero2", "zero2"), ("fsdp", "sharded3")]:
        check_memory(load_case(four, name), kind)
        check_memory(load_case(four, f"{name}_odd"), kind, ODD)
    # HSDP 2 x 2: each rank holds 1/2 of everything (sharded over the 2 ranks of its replica group)
    hsdp = load_case(four, "hsdp")
    a, rows = hsdp["num_params"], shard_slack("", 2)[1]
    for rank, mem in enumerate(hsdp["memory"]):
        for cat, per_param in (("params", 4), ("grads", 4), ("optimizer", 8)):
            want, slack = per_param * a / 2, per_param * rows  # dim-0 padding: < 1 row per tensor
            assert want - slack <= mem[cat] <= want + slack, (
                f"hsdp rank {rank} {cat}: {mem[cat]} bytes, formula {want:.0f} with a={a}, 2 shards")
    assert sum(m["optimizer"] for m in hsdp["memory"]) == 2 * 8 * a  # two replicas of the sharded state
    odd = load_case(four, "zero2_odd")["memory"]  # Adam state holds exactly the (clipped) slices
    assert odd[-1]["optimizer"] < odd[0]["optimizer"], "odd sizes should give the last rank a smaller slice"


@pytest.mark.launch
def test_shard_buckets_on_odd_sizes(four):
    b = torch.load(four / "buckets.pt", weights_only=True)
    assert b["max_error"] <= 1e-6 and b["gather_exact"]
    for i, size in enumerate(b["sizes"]):
        lengths = [per_rank[i] for per_rank in b["lengths"]]
        assert sum(lengths) == size and max(lengths) - min(lengths) <= -(-size // 4), (size, lengths)


# ----------------------------------------------------------------------------- state dicts


def assert_same_state(expected: dict, got: dict, name: str) -> None:
    assert expected["tensors"].keys() == got["tensors"].keys(), (
        f"{name}: keys differ: {sorted(set(expected['tensors']) ^ set(got['tensors']))[:6]}")
    for key, want in expected["tensors"].items():
        assert torch.equal(want, got["tensors"][key]), f"{name}: {key} differs after loading"
    assert expected["param_groups"] == got["param_groups"], name


@pytest.mark.launch
def test_state_dict_loads_across_strategies_and_world_sizes(two, four, tmp_path):
    expected = {name: torch.load(two / f"ckpt-{name}.expected.pt", weights_only=True) for name in SAVE}
    assert any(k.startswith("optim.") and k.endswith(".exp_avg") for k in expected["zero2"]["tensors"])
    muon = expected["ddp_muon"]["tensors"]  # the blocks' matrices on Muon, the embedding on AdamW
    assert "optim.blocks.0.mlp.fc.weight.momentum_buffer" in muon and "optim.tok_emb.weight.exp_avg" in muon
    assert not any(k.startswith("optim.blocks.0.mlp.fc.weight.exp_avg") for k in muon)
    for ckpt, name, _ in LOAD_TWO:
        assert_same_state(expected[ckpt], torch.load(two / f"{name}.pt", weights_only=True), f"{name} (2 ranks)")
    for ckpt, name, _ in LOAD_FOUR:
        assert_same_state(expected[ckpt], torch.load(four / f"{name}.pt", weights_only=True), f"{name} (4 ranks)")
    # ... and into one process without a process group (parallel.strategy=none)
    import torch.distributed.checkpoint as dcp

    from dp_worker import build, whole_state
    trainer = build(["trainer.resume=never", "parallel.strategy=none"], tmp_path)
    template = trainer.strategy.state_dict(trainer.optimizer)
    dcp.load(template, checkpoint_id=str(two / "ckpt-zero2"), no_dist=True)
    trainer.strategy.load_state_dict(template, trainer.optimizer)
    assert_same_state(expected["zero2"], whole_state(trainer.strategy, trainer.optimizer), "none_from_zero2")


# ----------------------------------------------------------------------------- the whole app

APP = {  # strategy -> overrides; every run: TINY, 10 steps, eval at 5 and 10
    "ddp": "parallel.strategy=ddp",
    "zero1": ZERO + "1",
    "zero2": ZERO + "2",
    "zero3": ZERO + "3",
    "fsdp": "parallel.strategy=fsdp parallel.cpu_offload=true",
}


def app_args(run_dir: Path, overrides: str) -> str:
    # lr_decay_steps = max_steps, spelled out so that a run cut at step 5 follows the same schedule
    return " ".join(TINY + [f"trainer.run_dir={run_dir}", "trainer.max_steps=10", "optimizer.lr_decay_steps=10",
                            overrides])


def final_val_loss(run_dir: Path) -> float:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10], f"{run_dir}: one metrics row per log step, got {rows}"
    return rows[-1]["val_loss"]


def check_model_pt(run_dir: Path) -> None:
    from model import GPT, GPTConfig
    payload = torch.load(run_dir / "model.pt", weights_only=True)
    want = GPT(GPTConfig(**payload["model_config"])).state_dict()
    assert payload["model"].keys() == want.keys(), f"{run_dir}: model.pt names {list(payload['model'])[:4]}"
    for k, v in payload["model"].items():
        assert type(v) is torch.Tensor and v.shape == want[k].shape, k


@pytest.mark.launch
def test_whole_app_every_strategy(tmp_path):
    # one process: strategy dp with fewer than 2 GPUs (none on the CPU) trains as plain one-process
    # training and says so
    single = tmp_path / "dp"
    r = python(["main.py", *app_args(single, "parallel.strategy=dp").split()])
    assert r.returncode == 0, r.stderr[-3000:]
    gpus = torch.cuda.device_count() if DEVICE == "cuda" else 0
    assert gpus >= 2 or f"warning: parallel.strategy=dp found {gpus} GPU(s)" in r.stderr, r.stderr[-2000:]
    check_model_pt(single)
    reference = final_val_loss(single)

    args = []
    for name, overrides in APP.items():
        args += ["--app", app_args(tmp_path / name, overrides)]
    # a snapshot written by zero-2 at step 5, resumed by fsdp up to step 10 (the real snapshot path)
    args += ["--app", app_args(tmp_path / "resumed", ZERO + "2 trainer.max_steps=5"),
             "--app", app_args(tmp_path / "resumed", "parallel.strategy=fsdp")]
    # must refuse: dp drives GPUs from one process; none would train two unsynchronised copies
    args += ["--app", app_args(tmp_path / "dp-multi", "parallel.strategy=dp")]
    args += ["--app", app_args(tmp_path / "none-multi", "parallel.strategy=none")]
    r = torchrun(2, ["tests/app_worker.py", "--out", str(tmp_path), *args])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert json.loads((tmp_path / "exit_codes.json").read_text()) == [0] * (len(APP) + 2) + [2, 2]
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 2, errors
    assert "parallel.strategy=dp drives all GPUs from ONE process" in errors[0], errors
    assert "parallel.strategy=none has no data parallelism but this launch has 2" in errors[1], errors
    for refused in ("dp-multi", "none-multi"):  # refused before anything was written
        assert not (tmp_path / refused).exists() or not any((tmp_path / refused).iterdir()), refused
    # zero-1/2/3 and fsdp runs use the collectives this torch recommends: no deprecation warning
    noisy = [l for l in (r.stdout + r.stderr).splitlines() if re.search("deprecat|futurewarning", l, re.I)]
    assert not noisy, noisy[:4]
    for name in APP:
        run_dir = tmp_path / name
        check_model_pt(run_dir)
        assert r.stdout.count(f"outputs in {run_dir}\n") == 1, f"{name}: 'done' must be printed once"
        val = final_val_loss(run_dir)  # mean over both dp ranks' halves = one process's loss
        assert abs(val - reference) <= 1e-4 * reference, f"{name}: val loss {val} vs one process {reference}"
    assert f"resumed from {tmp_path / 'resumed' / 'snapshots' / 'step_0000005'} at step 5" in r.stdout
    val = final_val_loss(tmp_path / "resumed")
    assert abs(val - reference) <= 1e-4 * reference, f"zero-2 -> fsdp resume: val loss {val} vs {reference}"
    assert_resumed_like_one_process(single, tmp_path / "resumed")


def assert_resumed_like_one_process(single: Path, resumed: Path) -> None:
    """The strategy switch held to the parity bounds of every figure the runs log, not the loss
    alone: the loss and pre-clip gradient norm at each log step and the parameters at the end. A
    resume that dropped the optimizer state moves the norm of step 10 and the final parameters."""
    for a, b in zip(metric_rows(single), metric_rows(resumed), strict=True):
        assert abs(a["loss"] - b["loss"]) <= LOSS_RTOL * a["loss"], ("loss", a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= NORM_RTOL * a["grad_norm"], (
            "zero-2 -> fsdp resume: gradient norm", a["step"], a["grad_norm"], b["grad_norm"])
    ta, tb = model_tensors(single), model_tensors(resumed)
    worst = max((ta[k] - tb[k]).abs().max().item() for k in ta)
    assert worst <= PARAM_ATOL, f"zero-2 -> fsdp resume: parameters {worst:.2e} from one process's"


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides, message", [
    (["parallel.strategy=zer"], "did you mean 'zero'"),
    (["parallel.strategy=zero", "parallel.zero_stage=4"], "parallel.zero_stage must be 1, 2 or 3"),
    (["parallel.strategy=zero", "parallel.zero_stage=0"], "parallel.zero_stage must be 1, 2 or 3"),
    (["parallel.strategy=ddp", "parallel.cpu_offload=true"], "parallel.cpu_offload only applies to"),
    (["parallel.strategy=ddp", "parallel.zero_stage=2"], "parallel.zero_stage only applies to"),
    (["parallel.strategy=zero", "parallel.reshard_after_forward=false"], "only applies to parallel.strategy=fsdp"),
    (["parallel.strategy=fsdp", "parallel.bucket_cap_mb=10"], "parallel.bucket_cap_mb only applies to"),
    (["parallel.strategy=dp", "parallel.static_graph=true"], "parallel.static_graph only applies to"),
    (["parallel.strategy=zero", "parallel.zero_stage=3", "parallel.bucket_cap_mb=10"],
     "parallel.bucket_cap_mb only applies to parallel.zero_stage=1 or 2"),
    # ZeRO-1/2 reduce with their own engine, not DDP: DDP's options do not apply to them
    (["parallel.strategy=zero", "parallel.zero_stage=1", "parallel.static_graph=true"],
     "parallel.static_graph only applies to parallel.strategy=ddp"),
    (["parallel.strategy=zero", "parallel.gradient_as_bucket_view=false"],
     "parallel.gradient_as_bucket_view only applies to parallel.strategy=ddp"),
    (["parallel.strategy=fsdp", "parallel.mixed_precision=fp8"], "parallel.mixed_precision='fp8' is not one of"),
    (["parallel.strategy=fsdp", "parallel.reduce_dtype=int8"], "parallel.reduce_dtype='int8' is not one of"),
    (["parallel.strategy=fsdp", "parallel.cpu_offload=maybe"], "must be true or false"),
])
def test_bad_config_one_line_exit_2(overrides, message, tmp_path, capsys):
    assert app.main(TINY + [f"trainer.run_dir={tmp_path}"] + overrides) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err
    assert not any(tmp_path.iterdir()), "nothing may be written before the config is valid"


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.strategy=dp"], 2, "parallel.strategy=dp drives all GPUs from ONE process"),
    (["parallel.strategy=zero", "trainer.batch_size=6", "trainer.micro_batch_size=0"], 4,
     "trainer.batch_size=6 is not divisible by the 4 data-parallel ranks"),
    (["parallel.strategy=fsdp", "trainer.batch_size=8", "trainer.micro_batch_size=3"], 2,
     "trainer.micro_batch_size=3 does not divide the per-rank batch 4"),
    (["parallel.strategy=ddp", "parallel.static_graph=true"], 2,
     "parallel.static_graph=true cannot be combined with gradient accumulation (2 micro-batches"),
    (["parallel.strategy=zero", "parallel.zero_stage=2", "parallel.tp=2"], 4,
     "parallel.zero_stage=2 shards plain tensors and does not compose with parallel.tp/pp > 1"),
    (["parallel.strategy=fsdp", "parallel.dp_replicate=3"], 4,
     "parallel.dp_replicate=3 does not divide the 4 data-parallel ranks"),
    (["parallel.strategy=fsdp", "parallel.dp_replicate=2", "parallel.tp=2"], 2,
     "parallel.dp_replicate=2 does not divide the 1 data-parallel ranks"),
    # `none` with several data-parallel ranks would train unsynchronised copies, each on its own
    # slice of the batch: a different model from one process. Every way to reach dp > 1 is refused.
    (["parallel.strategy=none"], 2, "parallel.strategy=none has no data parallelism but this launch has 2"),
    (["parallel.strategy=none", "parallel.tp=2"], 4,
     "parallel.strategy=none has no data parallelism but this launch has 2"),
    (["parallel.strategy=none", "parallel.pp=2", "trainer.batch_size=8"], 8,
     "parallel.strategy=none has no data parallelism but this launch has 4"),
])
def test_bad_layout(overrides, world, message):
    """World-size checks run in Layout.of, before any process group, model or strategy exists."""
    cfg = load_config(None, TINY + overrides)
    with pytest.raises(UsageError, match=re.escape(message)):
        Layout.of(cfg, world)


@pytest.mark.parametrize("overrides, world", [
    (["parallel.strategy=none"], 1),
    (["parallel.strategy=none", "parallel.tp=2"], 2),
    (["parallel.strategy=none", "parallel.pp=2"], 2),
    (["parallel.strategy=none", "parallel.tp=2", "parallel.pp=2"], 4),
])
def test_none_with_one_data_parallel_rank_is_a_layout(overrides, world):
    """`none` beside tp or pp (dp = 1) is one model split over ranks: legitimate, not refused."""
    assert Layout.of(load_config(None, TINY + overrides), world).dp == 1


def test_adamw_is_fused_on_fsdp2_shards_and_on_plain_tensors_not_on_a_mix():
    """parallel/strategy.py's AdamW takes the fused kernel where every parameter is of one kind:
    FSDP2's DTensor shards on one mesh (torch's fake process group here: 2 ranks, one process) or
    plain tensors; a mix of the two, or shards on two meshes (fsdp x tp), is not one kind (it steps
    in one fused call per kind: tests/test_adamw.py).
    The fused step on the shards computes what the fused step on plain copies of them computes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from model import GPT, GPTConfig
    from parallel.strategy import fusable

    def gpt() -> GPT:
        return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0))
    assert fusable([{"params": list(gpt().parameters())}])
    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        sharded, dp = gpt(), init_device_mesh("cpu", (4,))
        for block in sharded.blocks.values():
            fully_shard(block, mesh=init_device_mesh("cpu", (4,)))  # an equal mesh is one mesh
        shards = list(fully_shard(sharded, mesh=dp).parameters())
        assert fusable([{"params": shards[:3]}, {"params": shards[3:]}])
        assert not fusable([{"params": shards}, {"params": list(gpt().parameters())}])
        other = fully_shard(gpt(), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"])
        assert not fusable([{"params": shards}, {"params": list(other.parameters())}])
        torch.manual_seed(0)
        for p in shards:
            p.grad = p.detach().clone()
            p.grad.to_local().copy_(torch.randn_like(p.to_local()))
        plain = [torch.nn.Parameter(p.to_local().detach().clone()) for p in shards]
        for a, p in zip(plain, shards):
            a.grad = p.grad.to_local().clone()
        before = [a.detach().clone() for a in plain]
        for params in (shards, plain):
            opt = torch.optim.AdamW(params, lr=0.1, fused=True)
            opt.step(), opt.step()
        for a, p, b in zip(plain, shards, before):
            assert torch.equal(a, p.to_local()) and (a.numel() == 0 or not torch.equal(a, b))
    finally:
        dist.destroy_process_group()
