"""trainer.compile=true, the setting of the GPU preset (presets/gpu_8x8x512.yaml), run on the CPU:
parallelize compiles each block (torch.compile, inductor's C++ kernels here), or with
trainer.compile_scope=model (presets/cpu_fast.yaml) the whole model as one graph with its
embeddings eager, and the run trains as eager does: the same losses and gradient norms to float
rounding (the fused kernels sum in another order; 1e-5 relative, where a block left out of the step
or a gradient scaled twice would be off by far more)."""
from __future__ import annotations

import math

import pytest
import torch._dynamo
from torch._dynamo.utils import counters

from checks import load_config
from harness import app_in_process, metric_rows
from launch.build import build_trainer
from parallel.env import init_distributed
from testing.local import TINY

RTOL = 1e-5
RUN = TINY + ["parallel.strategy=none", "trainer.max_steps=6", "trainer.log_every=1", "trainer.sample_tokens=0"]


@pytest.mark.launch  # inductor starts a C++ compiler
@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_training_is_eagers(tmp_path, scope):
    train = app_in_process(RUN)
    assert train(tmp_path / "eager", "trainer.compile=false") == 0
    torch._dynamo.reset()
    counters.clear()
    assert train(tmp_path / "compiled", "trainer.compile=true", f"trainer.compile_scope={scope}") == 0
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # dynamo captured the blocks / model
    eager, compiled = metric_rows(tmp_path / "eager"), metric_rows(tmp_path / "compiled")
    steps = [r for r in eager if "loss" in r]
    assert len(steps) == 6 and [r["step"] for r in steps] == [r["step"] for r in compiled if "loss" in r]
    for a, b in zip(steps, (r for r in compiled if "loss" in r)):
        for key in ("loss", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=RTOL), (a["step"], key, a[key], b[key])
    val = [(a["val_loss"], b["val_loss"]) for a, b in zip(eager, compiled) if "val_loss" in a]
    assert val and all(math.isclose(x, y, rel_tol=RTOL) for x, y in val), val


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compile_scope_chooses_what_is_compiled_in_place(tmp_path, scope):
    """blocks: each block compiled and the model eager around them; model: the model compiled in
    place, its blocks not on their own (the graph holds them) and its embeddings eager (GPT.embed).
    Nothing is compiled yet: torch.compile works at the first call."""
    cfg = load_config(None, TINY + ["trainer.device=cpu", "parallel.strategy=none", "trainer.peak_flops=1e12",
                                    "trainer.compile=true", f"trainer.compile_scope={scope}",
                                    f"trainer.run_dir={tmp_path}"])
    model = build_trainer(cfg, init_distributed(cfg), tmp_path).strategy.unwrapped()[0]
    compiled = [b._compiled_call_impl is not None for b in model.blocks.values()]
    assert compiled == [scope == "blocks"] * len(compiled)
    assert (model._compiled_call_impl is not None) == (scope == "model")
    assert getattr(model.embed, "_torchdynamo_disable", False) == (scope == "model")  # embeddings eager in the graph's model
