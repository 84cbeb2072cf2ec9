"""A parallel run equals one process: the figures of K training steps of one layout (run_steps,
in this process or as one rank of a torchrun launch) and their comparison with the one-process
run's (assert_parity), for the parity tests and benchmarks/mesh_2x2x2.py.

A case passes only if every figure the run produces agrees with the one-process run: the loss and
the logged gradient norm at every step, the first-step gradients, and the parameters after the
first and the last step (bf16/fp16: see assert_parity). The norm check catches what the loss alone
let through (a clipping norm off by sqrt(2) moved the loss by only 1.15e-4 relative in 10 steps)."""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from checks import load_config
from launch.build import build_trainer
from parallel.env import init_distributed
from testing.local import TINY

GRAD_ATOL = 1e-6  # first-step gradients, absolute
LOSS_RTOL = 1e-4  # per-step losses, relative
NORM_RTOL = 1e-5  # per-step pre-clip gradient norms, relative
PARAM_ATOL = 1e-5  # parameters after the first and the last step, absolute
MIN_STEPS = 6  # fewer steps than this compare too little of the optimizer's trajectory
FP16_SCALE = 2.0 ** 16  # GradScaler's initial scale: fp16 first-step gradients are scaled by it


def parity_errors(ref: dict, got: dict) -> dict:
    """Worst difference of each compared figure (what the tolerances above bound)."""
    def rel(a, b):
        return 0.0 if a == b else abs(a - b) / abs(a) if math.isfinite(a) and a else math.inf
    return {
        "loss_rel": max(rel(a, b) for a, b in zip(ref["losses"], got["losses"])),
        "norm_rel": max(rel(a, b) for a, b in zip(ref["grad_norms"], got["grad_norms"])),
        "grad_abs": max((got["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items()),
        "param_abs": max((got["params"][k] - p).abs().max().item() for k, p in ref["params"].items()),
        "norm0_rel": rel(ref["grad_norms"][0], got["grad_norms"][0]),
        "first_param_abs": max((got["first_params"][k] - p).abs().max().item()
                               for k, p in ref["first_params"].items()),
    }


def assert_parity(ref: dict, got: dict, name: str, grad_scale: float = 1.0,
                  low_precision: bool = False) -> None:
    """Every run: loss at every step, first-step gradients, and the parameters after the first
    step. fp32 runs: also the gradient norm at every step and the parameters after the last step.

    `grad_scale`: the loss scale both runs' first-step gradients carry (fp16: the grad scaler's
    initial scale); they are compared unscaled (norms are taken after unscaling anyway).
    `low_precision` (bf16/fp16 autocast): the gradient norm and the parameters are compared after
    the first step only. Up to there both runs do the same arithmetic but for the order of
    summing fp32 gradients (measured: norm equal to 1e-7, parameters to 6e-8); from then on
    bf16/fp16 matmuls re-round every 1-ulp difference, and 10 steps later the norms differ by
    1e-5..1.5e-4 and the parameters by up to 1.4e-3 in every dp and pp layout measured (AdamW
    eps 1e-6..1e-4 did not bring the norms under 1e-5). The loss is still compared at every step."""
    if grad_scale != 1.0:
        ref = {**ref, "grads": {k: v / grad_scale for k, v in ref["grads"].items()}}
        got = {**got, "grads": {k: v / grad_scale for k, v in got["grads"].items()}}
    assert len(got["losses"]) == len(ref["losses"]) >= MIN_STEPS, name
    assert len(got["grad_norms"]) == len(ref["grad_norms"]) == len(ref["losses"]), name
    norm_steps = 1 if low_precision else len(ref["grad_norms"])
    for step, (a, b) in enumerate(zip(ref["grad_norms"][:norm_steps], got["grad_norms"])):
        # fp16: a step the grad scaler skips has an inf/nan norm, and must be skipped in both runs
        same = a == b or (not math.isfinite(a) and not math.isfinite(b))
        assert same or abs(a - b) <= NORM_RTOL * abs(a), (
            f"{name}: gradient norm at step {step}: {b} vs one process {a} (rel {abs(a - b) / abs(a):.1e})")
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{name}: loss at step {step}: {b} vs one process {a}"
    assert set(got["grads"]) == set(ref["grads"]), (
        f"{name}: gradient names differ: {sorted(set(got['grads']) ^ set(ref['grads']))}")
    for key, g in ref["grads"].items():
        diff = (got["grads"][key] - g).abs().max().item()
        assert diff <= GRAD_ATOL, f"{name}: first-step gradient of {key} differs by {diff:.2e}"
    for when in ("first_params",) if low_precision else ("first_params", "params"):
        assert set(got[when]) == set(ref[when]), (
            f"{name}: parameter names differ: {sorted(set(got[when]) ^ set(ref[when]))}")
        for key, p in ref[when].items():
            diff = (got[when][key] - p).abs().max().item()
            assert diff <= PARAM_ATOL, (
                f"{name}: parameter {key} after the {'first' if when == 'first_params' else 'last'} "
                f"step differs by {diff:.2e}")


def load_case(out, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


def build(overrides: list[str], run_dir: Path, base: list[str] = TINY):
    """main.py's Trainer for `base` + overrides writing to `run_dir`, in this process's launch (one
    process, or one rank of torchrun: the process group starts here unless it is up)."""
    cfg = load_config(None, base + [f"trainer.run_dir={run_dir}"] + list(overrides))
    return build_trainer(cfg, init_distributed(cfg), run_dir)


def run_steps(overrides: list[str], steps: int, run_dir: Path, memory_at_step: int = 1,
              evaluate: bool = False) -> dict:
    """Train `steps` steps of TINY + overrides in this process's launch (single process or one
    rank of torchrun). Returns losses (dp-mean, every step), the pre-clip gradient norm of every
    step (what metrics.jsonl logs as grad_norm), first-step gradients (whole, by name), the
    whole parameters after the last step (on rank 0; None on other ranks), each rank's resident
    bytes after the backward of step `memory_at_step`, and with `evaluate` the validation loss
    after the last step (Trainer.evaluate)."""
    trainer = build(overrides, run_dir)
    s = trainer.strategy
    env = s.env
    losses, norms, grads, memory, first_params = [], [], None, None, None
    for step in range(steps):
        loss = trainer.forward_backward()
        if step == 0:
            grads = s.full_grad_dict()
        if step == memory_at_step:
            mine = s.resident_bytes(trainer.optimizer)
            memory = [mine]
            if env.distributed:
                memory = [None] * env.world_size
                dist.all_gather_object(memory, mine)
        norms.append(float(trainer.optimizer_step()))
        losses.append(float(s.reduce_mean(loss)))
        if step == 0:
            first_params = _floats(s.full_model_state_dict())  # collective
    result = {"losses": losses, "grad_norms": norms, "grads": grads, "memory": memory,
              "first_params": first_params, "params": _floats(s.full_model_state_dict()),
              "world": env.world_size, "num_params": trainer.model_cost.num_params, "dp": s.dp_size}
    if evaluate:
        result["val_loss"] = trainer.evaluate()
    return result


def _floats(state: dict | None) -> dict | None:
    """Strategy.full_model_state_dict() (whole tensors on rank 0, None elsewhere) as fp32."""
    return state and {k: v.float() for k, v in state.items()}


def save_cases(cases: list[tuple[str, str]], steps: int, out: Path, **run_kwargs) -> None:
    """For a torchrun worker: run each (name, "overrides") case with run_steps in this launch's
    process group and save rank 0's result to OUT/NAME.pt."""
    for name, overrides in cases:
        result = run_steps(overrides.split(), steps, out / f"run-{name}", **run_kwargs)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
        dist.barrier()
