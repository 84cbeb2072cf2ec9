"""Temporary smoke test of the harness: ddp at dp=2 vs one process."""
import pytest

from harness import run_steps, torchrun
from parity import assert_parity, load_case

STEPS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_steps(["parallel.strategy=none"], STEPS, tmp_path_factory.mktemp("ref"))


def test_ddp(reference, tmp_path):
    r = torchrun(2, ["tests/parity_worker.py", "--out", str(tmp_path), "--steps", str(STEPS),
                     "--case", "ddp", "parallel.strategy=ddp"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_parity(reference, load_case(tmp_path, "ddp"), "ddp")
