"""trainer.precision=auto (parallel/precision.py) and presets/cpu_fast.yaml, which uses it: the choice
is a function of the CPU's flags, tested here on flag sets (bf16 instructions or none) without the
hardware; the launch resolves it before anything is built and says so in one start-up line; the
MFU peak is the resolved precision's; the preset keeps nanoGPT's CPU recipe. What the preset
achieves against nanoGPT is benchmarks/vs_nanogpt.py's (docs/performance.md), not this test's."""
from __future__ import annotations

import pytest
import torch

import main as app
from checks import load_config
from config import UsageError
from launch.build import build_trainer
from parallel import precision
from parallel.env import init_distributed
from testing.local import REPO, TINY

AVX2 = {"fpu", "sse2", "avx", "avx2", "fma"}


@pytest.mark.parametrize("flags, want", [
    (AVX2 | {"avx512f", "avx512_bf16"}, "bf16"),  # EPYC (Zen 4) with AVX512_BF16
    (AVX2 | {"avx512f", "amx_tile", "amx_bf16", "amx_int8"}, "bf16"),  # Sapphire Rapids' AMX
    (AVX2 | {"avx512f", "avx512_vnni"}, "fp32"),  # AVX-512 without its bf16 instructions
    (AVX2, "fp32"),
    (set(), "fp32"),  # no flags read (not Linux): the safe choice
])
def test_the_cpus_flags_choose_the_precision(flags, want):
    chosen, why = precision.fastest_cpu_precision(flags)
    assert chosen == want and why.startswith(want), why
    if want == "fp32":
        assert "neither amx_bf16 nor avx512_bf16" in why and "no bf16 instructions" in why, why
    else:
        assert any(f in why for f in precision.BF16_FLAGS if f in flags), why


def test_flags_are_read_from_cpuinfo_and_a_missing_file_reads_as_none(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert precision.cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert precision.cpu_flags(tmp_path / "absent") == set()


@pytest.mark.parametrize("flags, want", [({"avx512_bf16"}, "bf16"), ({"avx2"}, "fp32")])
def test_the_launch_resolves_auto_in_one_startup_line_and_records_it(flags, want, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo=precision.CPUINFO: flags)
    run = tmp_path / "run"
    assert app.main(TINY + ["trainer.device=cpu", "parallel.strategy=none", "trainer.max_steps=1",
                            "trainer.sample_tokens=0", "trainer.peak_flops=1e12", "trainer.precision=auto",
                            f"trainer.run_dir={run}"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("precision:")]
    assert len(lines) == 1 and f"trainer.precision=auto runs {want}" in lines[0], lines
    assert f"precision: {want}" in (run / "config.yaml").read_text()  # the choice, not "auto"


def test_a_trainer_built_with_auto_divides_mfu_by_the_peak_of_what_runs(tmp_path, monkeypatch):
    for flags, want in (({"amx_bf16"}, "bf16"), (set(), "fp32")):
        monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo=precision.CPUINFO, f=flags: f)
        cfg = load_config(None, TINY + ["trainer.device=cpu", "parallel.strategy=none", "trainer.precision=auto",
                                        "trainer.peak_flops=1e12", f"trainer.run_dir={tmp_path / want}"])
        trainer = build_trainer(cfg, init_distributed(cfg), tmp_path / want)
        assert trainer.cfg.trainer.precision == want and trainer.peak.precision == want


def test_an_explicit_precision_is_left_alone():
    cfg = load_config(None, ["trainer.precision=fp16"])
    assert precision.resolve_precision(cfg, torch.device("cpu")) == (cfg, None)


def test_the_fast_preset_keeps_nanogpts_cpu_recipe_at_the_fastest_precision():
    cfg = load_config(str(REPO / "presets" / "cpu_fast.yaml"), [])
    m, t, o = cfg.model, cfg.trainer, cfg.optimizer
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.dropout, m.bias) == (4, 4, 128, 64, 0.0, False)
    assert (t.batch_size, t.max_steps, t.grad_clip, t.device, t.precision) == (12, 2000, 1.0, "cpu", "auto")
    assert (o.name, o.lr, o.min_lr, o.warmup_steps, o.weight_decay, o.beta1, o.beta2) == (
        "adamw", 1e-3, 1e-4, 100, 0.1, 0.9, 0.99)
    assert o.lr_decay_steps in (0, 2000) and cfg.parallel.strategy == "none"
    assert (t.compile, t.compile_scope, t.attention) == (True, "model", "matmul")


def test_a_trainer_built_with_matmul_attention_trains_as_with_the_fused_kernel(tmp_path):
    """trainer.attention reaches every block (parallel/parallelize.py), and the two kernels train
    alike: the same loss and grad norm at each of 3 steps (fp32, one process)."""
    runs = {}
    for kernel in ("sdpa", "matmul"):
        cfg = load_config(None, TINY + ["trainer.device=cpu", "parallel.strategy=none", "trainer.peak_flops=1e12",
                                        f"trainer.attention={kernel}", f"trainer.run_dir={tmp_path / kernel}"])
        trainer = build_trainer(cfg, init_distributed(cfg), tmp_path / kernel)
        assert {b.attn.kernel for b in trainer.strategy.unwrapped()[0].blocks.values()} == {kernel}
        runs[kernel] = [tuple(float(v) for v in trainer.train_step()) for _ in range(3)]
    for (loss, norm), (loss2, norm2) in zip(runs["sdpa"], runs["matmul"]):
        assert abs(loss - loss2) <= 1e-6 * loss and abs(norm - norm2) <= 1e-5 * norm, runs


@pytest.mark.parametrize("flag", ["--plan", "--dry-run"])
def test_plan_and_dry_run_refuse_auto_in_one_line_exit_2(flag, capsys):
    """They price one precision; auto is chosen only at launch, on the device."""
    capsys.readouterr()
    assert app.main([flag, "trainer.precision=auto", "parallel.strategy=none"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "trainer.precision=auto is chosen at launch" in lines[0]


@pytest.mark.parametrize("flag", ["--plan", "--dry-run"])
def test_plan_and_dry_run_refuse_matmul_attention_in_one_line_exit_2(flag, capsys):
    """They price the fused attention; matmul attention's T x T probabilities are not modelled. So
    does parallel.strategy=auto, which plans with the same figures."""
    capsys.readouterr()
    assert app.main([flag, "trainer.attention=matmul", "parallel.strategy=none"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "trainer.attention=matmul holds" in lines[0]
    with pytest.raises(UsageError, match="parallel.strategy=auto plans the fused attention"):
        load_config(None, ["trainer.attention=matmul", "parallel.strategy=auto"])
