"""The command the project is built for, `torchrun --nproc_per_node=8 main.py`, trains with the
default config (gpt2_train_cfg.yaml, untouched but for the corpus, the run folder and a few steps)
and writes every output. One 8-process launch (CPU, gloo): about a minute on 2 cores, mostly the
start-up of 8 processes."""
from __future__ import annotations

import json

import torch

from harness import SHOWN_DEVICE
from launch.local import CORPUS, torchrun

STEPS = 3


def test_default_config_trains_on_eight_processes(tmp_path):
    run_dir = tmp_path / "run"
    r = torchrun(8, ["main.py", f"data.path={CORPUS}", f"trainer.run_dir={run_dir}",
                     f"trainer.max_steps={STEPS}", "trainer.eval_batches=2"], timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 0, "\n".join(errors) + r.stdout[-2000:] + r.stderr[-3000:]
    assert "world 8 = pp 1 x dp 8 (ddp (bucket " in r.stdout and f") x tp 1 | device {SHOWN_DEVICE}" in r.stdout, r.stdout[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [STEPS]  # the last step logs and evaluates
    assert all(torch.isfinite(torch.tensor([rows[0]["loss"], rows[0]["val_loss"], rows[0]["grad_norm"]])))
    payload = torch.load(run_dir / "model.pt", weights_only=True)
    assert payload["step"] == STEPS and payload["config"]["trainer"]["max_steps"] == STEPS
    assert (run_dir / "snapshots" / f"step_{STEPS:07d}" / "meta.json").is_file()
    assert (run_dir / "sample.txt").read_text(encoding="utf-8")
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tokenizer.json").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb (offline in tests) wrote no run"
    assert r.stdout.count("done: step 3") == 1, r.stdout[-2000:]
