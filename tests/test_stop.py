"""Stopping safely (issue 9, items 2 and 3): a SIGTERM to the torchrun agent or to one worker
stops every rank at one step with one snapshot of it, also when a second SIGTERM lands in the
middle of that snapshot's write, and the relaunch ends bit-identical; a non-finite loss or weight
at a step that is not logged is never snapshotted and stops the run with one line."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import main as app
from config import load_config
from harness import REPO, TINY, child_env, multiprocess_lock, torchrun, worker_pids
from parallel.env import init_distributed

# save_every=0 (TINY): the only snapshots are the stop snapshots and the final one, so a relaunch
# can only resume from what the stop wrote.
STOP = TINY + ["trainer.sample_tokens=0", "parallel.strategy=ddp", "model.n_embd=64",
               "trainer.max_steps=120", "trainer.log_every=10", "trainer.eval_every=40"]
STOP_LINE = re.compile(r"^stopped by SIGTERM at step (\d+): saved (\S+); run the same command again to resume$",
                       re.M)


def snapshots(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "snapshots").iterdir())


def model_tensors(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)["model"]


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rank_pid(agent_pid: int, rank: int) -> int:
    for pid in worker_pids(agent_pid):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker of rank {rank} under {agent_pid}")


def launch(run_dir: Path, target: str | None, max_restarts: int = 0, **env) -> tuple[int, str]:
    """torchrun with 2 ddp workers; once the first progress line shows training, send SIGTERM to
    `target` ('agent' = torchrun itself, which forwards it to every worker; 'rank1' = only that
    worker). Returns (exit code, stdout + stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "main.py", *STOP,
           f"trainer.run_dir={run_dir}"]
    lines: list[str] = []
    with multiprocess_lock():
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        try:
            if target is not None:
                deadline = time.time() + 120
                while time.time() < deadline and proc.poll() is None and \
                        not any(l.startswith("step ") for l in lines):
                    time.sleep(0.02)
                assert proc.poll() is None, "".join(lines)[-3000:]
                os.kill(proc.pid if target == "agent" else rank_pid(proc.pid, 1), signal.SIGTERM)
            rc = proc.wait(timeout=200)
        finally:
            if proc.poll() is None:
                proc.kill()
        reader.join(timeout=10)
    return rc, "".join(lines)


def stop_of(out: str) -> tuple[int, str]:
    found = STOP_LINE.findall(out)
    assert len(found) == 1, out[-4000:]  # one closing line per job, not one per rank
    return int(found[0][0]), found[0][1]


def test_sigterm_stops_at_one_step_saves_it_and_relaunch_matches(tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "run"
    r = torchrun(2, ["main.py", *STOP, f"trainer.run_dir={reference}"], timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

    # (a) SIGTERM to the torchrun agent mid-run: it forwards SIGTERM to both workers.
    rc, out = launch(run, "agent")
    step_a, path_a = stop_of(out)
    assert 0 < step_a < 120, out[-4000:]
    assert snapshots(run) == [f"step_{step_a:07d}"] and Path(path_a) == run / "snapshots" / snapshots(run)[0]
    assert rc == 1  # torchrun re-raises the signal it got (SignalException): the job did not finish
    assert not (run / "model.pt").exists()  # a stop is not the end of training

    # (b) SIGTERM to rank 1 only, (c) and a second SIGTERM to rank 0 in the middle of the stop
    # snapshot's write. --max-restarts=1: the workers exit 0, so the agent must not restart them.
    rc, out = launch(run, "rank1", max_restarts=1, MINGPT_FAULT="term:save:*:0")
    assert rc == 0, out[-4000:]
    assert "[fault] rank 0 sends itself SIGTERM at save" in out, out[-4000:]
    assert out.count("resumed from") == 1, out[-4000:]  # this launch's own resume; no restart
    step_b, path_b = stop_of(out)
    assert step_a < step_b < 120, out[-4000:]
    assert snapshots(run) == [f"step_{step_a:07d}", f"step_{step_b:07d}"], out[-4000:]

    # the relaunch resumes from the stop snapshot and ends as if nothing happened
    r = torchrun(2, ["main.py", *STOP, f"trainer.run_dir={run}"], timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"step_{step_b:07d} at step {step_b}" in r.stdout
    ta, tb = model_tensors(reference), model_tensors(run)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert metric_steps(run) == metric_steps(reference)


# ----------------------------------------------------------------------------- non-finite

# log_every=5: step 4 is a save step that is not a log step; keep_snapshots=1, so a NaN snapshot
# at step 4 would prune the good one at step 2.
NAN = TINY + ["trainer.sample_tokens=0", "trainer.max_steps=10", "trainer.save_every=2",
              "trainer.keep_snapshots=1"]


def test_nan_weights_in_one_process_are_never_snapshotted(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    args = NAN + ["parallel.strategy=none", f"trainer.run_dir={run}"]
    monkeypatch.setenv("MINGPT_FAULT", "nan:update:4:0")  # the weights turn NaN in step 4's update
    capsys.readouterr()
    assert app.main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "non-finite" in err[0], err
    assert "step 4" in err[0] and "step_0000002" in err[0], err
    assert snapshots(run) == ["step_0000002"]
    monkeypatch.delenv("MINGPT_FAULT")
    assert app.main(args) == 0
    assert "step_0000002 at step 2" in capsys.readouterr().out
    assert snapshots(run) == ["step_0000010"]


def test_nan_loss_on_one_rank_is_agreed_and_never_snapshotted(tmp_path, capsys):
    run = tmp_path / "run"
    # Rank 1's weights turn NaN after step 3: its loss of step 4 is NaN, rank 0's is finite (the
    # gradient all-reduce spreads the NaN only into step 4's update). Step 4 is saved, not logged.
    r = torchrun(2, ["main.py", *NAN, "parallel.strategy=ddp", f"trainer.run_dir={run}"], timeout=200,
                 MINGPT_FAULT="nan:update:3:1")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    errs = [l for l in (r.stdout + r.stderr).splitlines() if l.startswith("error: ")]
    assert len(errs) == 1 and "loss" in errs[0] and "step 4" in errs[0] and "step_0000002" in errs[0], errs
    assert snapshots(run) == ["step_0000002"]
    capsys.readouterr()
    assert app.main(NAN + ["parallel.strategy=none", f"trainer.run_dir={run}"]) == 0  # resumes in one process
    assert "step_0000002 at step 2" in capsys.readouterr().out


def test_fp16_steps_the_grad_scaler_skips_are_not_failures(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, NAN + ["parallel.strategy=none", "trainer.precision=fp16", "trainer.max_steps=4",
                                   f"trainer.run_dir={run}"])
    trainer = app.build_trainer(cfg, init_distributed(cfg), run)
    trainer.scaler.scale(torch.ones(()))  # creates the scale tensor, then make it overflow fp16
    trainer.scaler.update(new_scale=2.0**100)
    assert trainer.train()["final_step"] == 4
    assert trainer.scaler.get_scale() == 2.0**96  # all 4 steps had inf gradients and were skipped
    assert snapshots(run) == ["step_0000004"]
