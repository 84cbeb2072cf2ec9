"""parallel.strategy=auto: the planner picks the layout at launch (planner/auto.py).

Under torchrun at 2 ranks the launch trains with the fastest predicted layout that fits, prints
the choice and the runner-up after the start-up view, and config.yaml records the resolved
layout with the world size it was chosen for; a resume on the same world size keeps it. Bad
values of the keys are one line and exit 2.
"""
from __future__ import annotations

import dataclasses

import pytest
import yaml

import main as app
from checks import load_config
from planner.auto import candidates, resolved_config
from planner.hardware import load_hardware
from testing.local import TINY, torchrun


@pytest.mark.launch
def test_auto_trains_under_torchrun_and_a_resume_keeps_the_choice(tmp_path):
    run = tmp_path / "run"
    args = ["main.py", *TINY, f"trainer.run_dir={run}", "parallel.strategy=auto", "trainer.sample_tokens=0"]
    first = torchrun(2, [*args, "trainer.max_steps=4"], timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "auto: chose " in first.stdout and "auto: runner-up " in first.stdout
    chosen = yaml.safe_load((run / "config.yaml").read_text())["parallel"]
    assert chosen["strategy"] != "auto" and chosen["auto_world_size"] == 2
    # what the planner predicts fastest among the layouts that fit, asked here with the launch's own
    # config and this machine's figures (the CPU peak and link figures the launch cached)
    cfg = load_config(None, args[1:] + ["trainer.max_steps=4"])
    found = candidates(cfg, 2, None, 0, load_hardware("local", cfg.trainer.precision))
    fastest = dataclasses.asdict(resolved_config(*found[0], 2).parallel)
    assert {k: chosen[k] for k in fastest} == fastest, (chosen, fastest)
    again = torchrun(2, [*args, "trainer.max_steps=6"], timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "auto: keeps the layout chosen for 2 ranks" in again.stdout and "resumed from" in again.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["parallel"] == chosen


@pytest.mark.parametrize("overrides, message", [
    (["parallel.device_memory=40XB"], "parallel.device_memory='40XB' is not a memory size"),
    (["parallel.strategy=auto", "parallel.tp=2"], "parallel.tp is chosen by parallel.strategy=auto"),
    # not "only applies with parallel.tp > 1": under auto, setting tp is no fix
    (["parallel.strategy=auto", "parallel.tp_vocab_parallel=true"], "parallel.tp_vocab_parallel is chosen by"),
    (["parallel.strategy=auto", "parallel.pp_schedule=gpipe"], "parallel.pp_schedule is chosen by"),
])
def test_auto_bad_values_one_line_exit_2(tmp_path, capsys, overrides, message):
    assert app.main([*TINY, f"trainer.run_dir={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_auto_splits_each_sequence_when_nothing_else_fits():
    """8,192 tokens of one sequence fit no layout of 4 ranks in 32.5 MB, with or without
    recomputation (the smallest plan: 34.5 MB); split over 4 cp ranks they do (each holds 2,048;
    fsdp: 31.7 MB): auto resolves to the fastest cp layout, and the launch's checks accept it."""
    cfg = load_config(None, ["trainer.device=cpu", "model.n_layer=2", "model.n_embd=64", "model.block_size=8192",
                             "model.dropout=0", "trainer.batch_size=4", "trainer.micro_batch_size=1",
                             "parallel.strategy=auto"])
    hardware = load_hardware("h100-sxm", "fp32")
    found = candidates(cfg, 4, 33 * 10**6, 5 * 10**5, hardware)
    assert found and all(v.parallel.cp == 4 for _, v in found), [v.parallel.cp for _, v in found]
    chosen = resolved_config(*found[0], 4).parallel
    assert (chosen.cp, chosen.strategy) == (4, "fsdp") and found[0][0].fits, chosen
    # with room for the whole sequence no cp is tried
    assert all(v.parallel.cp == 1 for _, v in candidates(cfg, 4, 10**9, 10**6, hardware))
