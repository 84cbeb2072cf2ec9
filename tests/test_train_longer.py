"""Relaunching a finished run: what a launch with nothing left to train, and one that trains
longer with a changed LR schedule, print and change.

- A launch with nothing left to train (resumed at or past its last step) says so in one line
  (the step reached, how to train longer, how to start fresh), exits 0 and changes nothing in
  the run folder: no metrics row, no model.pt or sample.txt rewrite, no tracker run.
- Training longer with a schedule that now runs differently from the resume step (here: the
  cosine follows a longer trainer.max_steps) prints one line naming the LR the snapshot's
  schedule would have continued with, the LR that now runs, and optimizer.lr_decay_steps to keep
  the curve; a resume whose schedule is unchanged prints no such line.
"""
from __future__ import annotations

from pathlib import Path

from checks import load_config
from harness import app_in_process
from launch.schedule import lr_at
from testing.local import TINY

BASE = TINY + ["parallel.strategy=none", "trainer.sample_tokens=20"]


train = app_in_process(BASE)


def listing(run_dir: Path) -> dict:
    """Every file and folder with its bytes and modification time: a rewrite with equal bytes counts."""
    return {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in run_dir.rglob("*")}


def test_nothing_left_to_train_says_so_and_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "trainer.max_steps=5") == 0
    assert (run / "model.pt").is_file() and (run / "sample.txt").is_file()
    before = listing(run)
    capsys.readouterr()
    for max_steps in (5, 3):  # at the last step, and past it
        # wandb on (offline in tests): an opened run would add a wandb/ folder to the listing
        assert train(run, f"trainer.max_steps={max_steps}", "wandb.enabled=true") == 0
        out, err = capsys.readouterr()
        lines = [l for l in out.splitlines() if "nothing left to train" in l]
        assert len(lines) == 1, out
        line = lines[0]
        assert f"{run} is at step 5" in line and f"trainer.max_steps={max_steps}" in line, line
        assert "trainer.max_steps=N" in line and "optimizer.lr_decay_steps=5" in line, line
        assert "another trainer.run_dir" in line, line
        assert "done:" not in out and "--- sample ---" not in out and "resumed from" not in out, out
        assert listing(run) == before, max_steps


def test_training_longer_names_the_lr_change_at_the_resume_step(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "trainer.max_steps=10", "optimizer.lr_decay_steps=0") == 0
    capsys.readouterr()
    assert train(run, "trainer.max_steps=14", "optimizer.lr_decay_steps=0") == 0
    out = capsys.readouterr().out
    old = load_config(None, BASE + ["trainer.max_steps=10"])
    new = load_config(None, BASE + ["trainer.max_steps=14"])
    was, now = lr_at(10, old, 10), lr_at(10, new, 14)
    assert abs(now - was) > 0.1 * was  # the cosine really jumps here
    lines = [l for l in out.splitlines() if l.startswith("note: the LR schedule changes")]
    assert len(lines) == 1, out
    line = lines[0]
    assert f"at step 10 the snapshot's schedule would continue with lr {was:.3e}, now {now:.3e}" in line, line
    assert "the cosine now decays over 14 steps (trainer.max_steps" in line and ", not 10;" in line, line
    assert "optimizer.lr_decay_steps=10 keeps the snapshot's curve" in line, line

    # a fixed decay length: trained longer, the schedule from the resume step on is the same one
    fixed = tmp_path / "fixed"
    assert train(fixed, "trainer.max_steps=5", "optimizer.lr_decay_steps=20") == 0
    assert train(fixed, "trainer.max_steps=8", "optimizer.lr_decay_steps=20") == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "note: the LR schedule" not in out, out
