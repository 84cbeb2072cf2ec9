"""The presets the README names load as the launch loads them and describe a model the code builds:
presets/cpu_speedrun.yaml (nanoGPT's CPU model with Muon), presets/cpu_fast.yaml (nanoGPT's CPU
recipe at the CPU's fastest precision, compiled), presets/gpu_8x8x512.yaml (bf16, compile, CUDA) and
presets/cpu_long_context.yaml (sequences split over 4 cp ranks). What each achieves is a benchmark's (benchmarks/time_to_loss.py) or the GPU check's
(scripts/gpu_check.sh), not this test's: here, that neither has drifted from the config's keys and
checks, and that each keeps the settings the README and docs/performance.md state."""
from __future__ import annotations

import pytest
import torch

import main as app
from checks import load_config
from model import GPT, GPTConfig
from testing.local import REPO


@pytest.mark.parametrize("preset, want", [
    ("cpu_speedrun.yaml", {"device": "cpu", "optimizer": "muon", "shape": (4, 4, 128), "compile": False}),
    ("gpu_8x8x512.yaml", {"device": "cuda", "optimizer": "adamw", "shape": (8, 8, 512), "compile": True}),
    ("cpu_fast.yaml", {"device": "cpu", "optimizer": "adamw", "shape": (4, 4, 128), "compile": True}),
    ("cpu_long_context.yaml", {"device": "cpu", "optimizer": "adamw", "shape": (2, 4, 128), "compile": False}),
])
def test_a_preset_loads_and_its_model_builds(preset, want):
    cfg = load_config(str(REPO / "presets" / preset), [])
    m = cfg.model
    assert (cfg.trainer.device, cfg.optimizer.name, (m.n_layer, m.n_head, m.n_embd), cfg.trainer.compile) == (
        want["device"], want["optimizer"], want["shape"], want["compile"])
    with torch.device("meta"):
        gpt = GPT(GPTConfig.of(m, 65))
    assert len(gpt.blocks) == m.n_layer


def test_the_long_context_preset_fits_only_with_cp(capsys):
    """presets/cpu_long_context.yaml, with the memory its header names: at cp=1 no layout of 4
    ranks holds its 4,096-token sequences; its own layout, cp=4, fits. (A shipped hardware file:
    --plan's default, local, would calibrate this machine; memory does not depend on it.)"""
    base = ["--plan", "--world-size", "4", "--device-memory", "45MB", "--reserve-memory", "5MB", "--hardware",
            "h100-sxm", "--config", str(REPO / "presets" / "cpu_long_context.yaml")]
    header = (REPO / "presets" / "cpu_long_context.yaml").read_text()
    assert " ".join(base[1:7]) in header  # the command the header prints
    assert app.main([*base, "parallel.cp=1"]) == 0
    assert "nothing fits" in capsys.readouterr().out
    assert app.main(base) == 0
    configured = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("*  "))
    assert "none dp1 x cp4 ring" in configured and " yes " in configured, configured
