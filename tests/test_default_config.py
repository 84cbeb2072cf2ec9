"""The command the project is built for, `torchrun --nproc_per_node=8 main.py`, trains with the
default config (gpt2_train_cfg.yaml, untouched but for the corpus, the run folder and a few steps)
and writes every output on 8 CPU processes (gloo). The run is main.main, what that command runs,
inside the session's one 8-process launch (conftest.eight_processes: 8 start-ups cost ~30 s on 2
cores) after the 3-D mesh's cases, in the process group they used; its exit code is the worst
over the 8 ranks."""
from __future__ import annotations

import json

import pytest
import torch

from harness import SHOWN_DEVICE

pytestmark = pytest.mark.launch

STEPS = 3  # benchmarks/mesh_2x2x2.py DEFAULT_STEPS


def test_default_config_trains_on_eight_processes(eight_processes):
    r, out = eight_processes
    run_dir, log, codes = out / "default", out / "launch.out", out / "app_exit_codes.json"
    launch = log.read_text() if log.is_file() else ""  # absent if the launch never ran
    errors = [line for line in launch.splitlines() if line.startswith("error:")]
    assert codes.is_file() and json.loads(codes.read_text())[1] == 0, (
        "\n".join(errors) + r.stdout[-2000:] + r.stderr[-2000:] + launch[-3000:])
    assert "world 8 = pp 1 x dp 8 (ddp (bucket " in launch and f") x tp 1 | device {SHOWN_DEVICE}" in launch, launch[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [STEPS]  # the last step logs and evaluates
    assert all(torch.isfinite(torch.tensor([rows[0]["loss"], rows[0]["val_loss"], rows[0]["grad_norm"]])))
    payload = torch.load(run_dir / "model.pt", weights_only=True)
    assert payload["step"] == STEPS and payload["config"]["trainer"]["max_steps"] == STEPS
    assert (run_dir / "snapshots" / f"step_{STEPS:07d}" / "meta.json").is_file()
    assert (run_dir / "sample.txt").read_text(encoding="utf-8")
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tokenizer.json").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb (offline in tests) wrote no run"
    assert launch.count(f"done: step {STEPS} |") == 1, launch[-2000:]  # one line, not one per rank
