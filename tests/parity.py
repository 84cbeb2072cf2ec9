"""Assertions shared by the parity tests: a parallel run equals one process."""
from __future__ import annotations

import torch

GRAD_ATOL = 1e-6  # first-step gradients, absolute
LOSS_RTOL = 1e-4  # per-step losses, relative


def assert_parity(ref: dict, got: dict, name: str) -> None:
    assert len(got["losses"]) == len(ref["losses"]) >= 10, name
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{name}: loss at step {step}: {b} vs one process {a}"
    assert set(got["grads"]) == set(ref["grads"]), (
        f"{name}: gradient names differ: {sorted(set(got['grads']) ^ set(ref['grads']))}")
    for key, g in ref["grads"].items():
        diff = (got["grads"][key] - g).abs().max().item()
        assert diff <= GRAD_ATOL, f"{name}: first-step gradient of {key} differs by {diff:.2e}"


def load_case(out, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)
