"""trainer.compile=true, the setting of the GPU preset (presets/gpu_8x8x512.yaml), run on the CPU:
parallelize compiles each block (torch.compile, inductor's C++ kernels here), and the run trains
as eager does: the same losses and gradient norms to float rounding (the fused kernels sum in
another order; 1e-5 relative, where a block left out of the step or a gradient scaled twice would
be off by far more)."""
from __future__ import annotations

import math

import pytest
import torch._dynamo
from torch._dynamo.utils import counters

from harness import app_in_process, metric_rows
from testing.local import TINY

RTOL = 1e-5
RUN = TINY + ["parallel.strategy=none", "trainer.max_steps=6", "trainer.log_every=1", "trainer.sample_tokens=0"]


@pytest.mark.launch  # inductor starts a C++ compiler
def test_compiled_blocks_train_as_eager_does(tmp_path):
    train = app_in_process(RUN)
    assert train(tmp_path / "eager", "trainer.compile=false") == 0
    torch._dynamo.reset()
    counters.clear()
    assert train(tmp_path / "compiled", "trainer.compile=true") == 0
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # dynamo captured the blocks
    eager, compiled = metric_rows(tmp_path / "eager"), metric_rows(tmp_path / "compiled")
    steps = [r for r in eager if "loss" in r]
    assert len(steps) == 6 and [r["step"] for r in steps] == [r["step"] for r in compiled if "loss" in r]
    for a, b in zip(steps, (r for r in compiled if "loss" in r)):
        for key in ("loss", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=RTOL), (a["step"], key, a[key], b[key])
    val = [(a["val_loss"], b["val_loss"]) for a, b in zip(eager, compiled) if "val_loss" in a]
    assert val and all(math.isclose(x, y, rel_tol=RTOL) for x, y in val), val
