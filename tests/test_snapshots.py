"""Snapshots: bit-exact resume, SIGKILL of a worker under torchrun --max-restarts during a
snapshot write and at random moments, keep policy, resume rules (damaged snapshots:
tests/test_snapshot_safety.py).

Launches: the session's long_ddp_reference (tests/conftest.py, shared with tests/test_stop.py);
one torchrun whose workers are killed three times (once mid-save, twice at random); and
`python sample.py` with a bad command line. Everything else trains in this process."""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

import export as export_cmd
import sample as sample_cmd
from conftest import LONG_DDP_REFERENCE, LONG_STEPS
from harness import StreamedLaunch, app_in_process, metric_steps, model_tensors
from testing.local import TINY, python, torchrun_argv, worker_pids

# The cosine schedule's length is fixed, so a run cut at step k and resumed with a larger
# max_steps follows the same LR curve as the uninterrupted one.
NO_SAMPLE = ["trainer.sample_tokens=0", "optimizer.lr_decay_steps=20"]
# The random kills' seed: fixed, so a failure reruns with the same delays and victims (the moments
# still move with the machine's speed); printed in every failure. MINGPT_KILL_SEED explores others.
KILL_SEED = int(os.environ.get("MINGPT_KILL_SEED", "1"))


def assert_bit_identical(a: Path, b: Path) -> None:
    ta, tb = model_tensors(a), model_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"{k} differs: max {(ta[k] - tb[k]).abs().max().item():.3e}"


train = app_in_process(TINY + NO_SAMPLE + ["parallel.strategy=none"])


def test_resume_is_bit_identical_and_keeps_newest(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert train(full, "trainer.max_steps=20", "trainer.save_every=5", "trainer.keep_snapshots=2") == 0
    snaps = sorted(p.name for p in (full / "snapshots").iterdir())
    assert snaps == ["step_0000015", "step_0000020"], snaps  # keep_snapshots=2, no temp folders
    assert train(cut, "trainer.max_steps=10", "trainer.save_every=5") == 0
    assert train(cut, "trainer.max_steps=20", "trainer.save_every=5") == 0  # more steps: a safe change
    assert_bit_identical(full, cut)
    assert metric_steps(cut) == metric_steps(full) == [5, 10, 15, 20]


def test_resume_rules(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "trainer.max_steps=5", "trainer.save_every=5") == 0
    before = {p: p.read_bytes() for p in (run / "snapshots").rglob("*") if p.is_file()}
    capsys.readouterr()
    # another model shape: refused, one line, snapshot untouched
    assert train(run, "trainer.max_steps=10", "model.n_layer=2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different model shape" in err[0]
    # resume=never on a folder with snapshots: refused
    assert train(run, "trainer.max_steps=10", "trainer.resume=never") == 2
    assert "trainer.resume=never" in capsys.readouterr().err
    # resume=require on an empty folder: refused
    assert train(tmp_path / "empty", "trainer.resume=require") == 2
    assert "holds no valid snapshot" in capsys.readouterr().err
    after = {p: p.read_bytes() for p in (run / "snapshots").rglob("*") if p.is_file()}
    assert before == after


@pytest.mark.launch
def test_export_and_sample_from_snapshot(tmp_path, capsys):
    """An export never replaces a newer model.pt: `--step N` writes model_step_N.pt beside it and
    says so; sample.py --model and model.init_from take that file; without --step the newest
    snapshot becomes model.pt, and a model.pt from a later step than any snapshot is kept. The
    commands run in this process (their main(), what `python export.py` runs) but the last: a
    bad command line as the shell sees it."""

    def command(main, *argv: str):
        capsys.readouterr()
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err
    run = tmp_path / "run"
    assert train(run, "trainer.max_steps=5", "trainer.save_every=5") == 0
    at_5 = model_tensors(run)
    assert train(run, "trainer.max_steps=10", "trainer.save_every=5") == 0
    final = (run / "model.pt").read_bytes()
    code, out, err = command(export_cmd.main, "--run-dir", str(run), "--step", "5")
    assert code == 0, err
    older = run / "model_step_0000005.pt"
    assert out == f"wrote {older} from step 5 ({run / 'model.pt'}, step 10, is left as it is)\n", out
    assert (run / "model.pt").read_bytes() == final, "an export of step 5 replaced the step-10 model.pt"
    exported = torch.load(older, weights_only=True)
    assert exported["step"] == 5 and exported["model"].keys() == at_5.keys()
    for k, v in exported["model"].items():
        assert torch.equal(v, at_5[k]), k
    code, out, err = command(sample_cmd.main, "--model", str(older), "--prompt", "ROMEO:", "--tokens", "20")
    assert code == 0 and out.startswith("ROMEO:"), err
    assert train(tmp_path / "tuned", f"model.init_from={older}", "trainer.max_steps=1") == 0
    # no --step: the newest snapshot (step 10) is model.pt's own step: model.pt is rewritten
    (run / "model.pt").unlink()
    code, out, err = command(export_cmd.main, "--run-dir", str(run))
    assert code == 0 and out == f"wrote {run / 'model.pt'} from step 10\n", out + err
    assert (run / "model.pt").read_bytes() != b"" and model_tensors(run).keys() == at_5.keys()
    # a model.pt newer than every snapshot (the snapshots were pruned) is kept, not overwritten
    shutil.rmtree(run / "snapshots" / "step_0000010")
    before = (run / "model.pt").read_bytes()
    code, out, err = command(export_cmd.main, "--run-dir", str(run))
    assert code == 0, err
    assert out == f"wrote {older} from step 5 ({run / 'model.pt'}, step 10, is left as it is)\n", out
    assert (run / "model.pt").read_bytes() == before
    code, out, err = command(sample_cmd.main, "--run-dir", str(run), "--snapshot", "--prompt", "ROMEO:", "--tokens", "20")
    assert code == 0 and out.startswith("ROMEO:"), err
    # sample.py needs one of --run-dir and --model
    r = python(["sample.py", "--prompt", "x"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--run-dir" in r.stderr and "--model" in r.stderr, r.stderr


# ----------------------------------------------------------------------------- elastic restarts


def launch_and_kill(run_dir: Path, kills: int, env: dict, after: str, max_restarts: int = 5,
                    seed: int = 0) -> tuple[int, str]:
    """torchrun --max-restarts with 2 ddp workers; once a line holding `after` is printed, SIGKILL
    a random worker `kills` times, each at a random moment once that attempt is training. Returns
    (exit code, output)."""
    rnd = random.Random(seed)
    cmd = torchrun_argv(2, ["main.py", *LONG_DDP_REFERENCE, f"trainer.run_dir={run_dir}"],
                        [f"--max-restarts={max_restarts}", "--monitor-interval=0.2"])
    with StreamedLaunch(cmd, **env) as job:
        job.wait_for(lambda: any(after in line for line in job.lines))
        seen = next((i for i, line in enumerate(job.lines) if after in line), len(job.lines))
        for k in range(kills):
            # wait until this attempt trains: a progress line after its own start-up line ("run: ...");
            # a line of the attempt just killed can still arrive after the kill, and a kill timed from
            # it would land in the next attempt's start-up
            job.wait_for(lambda: attempt_trains(job.lines, seen))
            started = time.monotonic()
            # a random moment: past the progress line of a random logged step after this attempt's
            # first, a random part of the next 10 steps (mid-step, mid-save, mid-eval), timed by
            # this attempt's own pace. Drawn in steps, not seconds: 70 steps take 0.6 s on a fast
            # machine, and a delay of up to 1.5 s drawn in seconds landed after the run's end (seed
            # 2), so one of the kills never happened. Each kill leaves 10 steps for each kill after
            # it, and the last 10 untouched.
            steps = attempt_steps(job.lines, seen)
            if not steps:  # the launch ended
                break
            first = steps[0]
            last = LONG_STEPS - 20 - 10 * (kills - 1 - k)
            target = rnd.choice(range(first + 10, max(first + 10, last) + 1, 10))
            job.wait_for(lambda: max(attempt_steps(job.lines, seen), default=0) >= target)
            pace = (time.monotonic() - started) / ((target - first) // 10)  # seconds per 10 steps
            time.sleep(rnd.uniform(0.0, 0.9 * pace))
            pids = worker_pids(job.proc.pid)
            if job.proc.poll() is not None or not pids:
                break
            victim = rnd.choice(pids)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.lines.append(f"[test] killed worker pid {victim} (kill {k + 1}/{kills}, seed {seed})\n")
            seen = len(job.lines)
        rc = job.proc.wait(timeout=300)
    return rc, job.output()


def attempt_steps(lines: list[str], start: int) -> list[int]:
    """The steps of the progress lines ("step 60/120 ...") printed by the attempt whose start-up
    line ("run: ...") is the first at or after `start`."""
    began = next((i for i in range(start, len(lines)) if lines[i].startswith("run: ")), len(lines))
    return [int(m.group(1)) for line in lines[began + 1:] if (m := re.match(r"step (\d+)/", line))]


def attempt_trains(lines: list[str], start: int) -> bool:
    """Has the attempt whose start-up line ("run: ...") is the first at or after `start` printed a
    progress line since?"""
    began = next((i for i in range(start, len(lines)) if lines[i].startswith("run: ")), None)
    return began is not None and any(line.startswith("step ") for line in lines[began + 1:])


@pytest.mark.launch
def test_sigkill_mid_save_then_at_random_moments_restarts_and_matches(long_ddp_reference, tmp_path):
    """One launch, three kills: rank 1 is SIGKILLed right after writing its shards of snapshot 60,
    the folder still temporary (`kill:save:60:1`, first attempt only): the restart resumes from 50
    and the temporary folder is never loaded. Then, once that resume is printed, a random worker is
    killed twice at random moments (seed MINGPT_KILL_SEED, printed in every failure). The run ends
    bit-identical to the uninterrupted one, with no temporary folder left and no metrics row twice."""
    run = tmp_path / "killed"
    snaps = run / "snapshots"
    rc, out = launch_and_kill(run, kills=2, env={"MINGPT_FAULT": "kill:save:60:1"},
                              after=f"resumed from {snaps / 'step_0000050'} at step 50", seed=KILL_SEED)
    seed = f"MINGPT_KILL_SEED={KILL_SEED}: "
    assert rc == 0, seed + out[-4000:]
    resumes = re.findall(r"resumed from (\S+) at step (\d+)", out)
    assert resumes[:1] == [(str(snaps / "step_0000050"), "50")], seed + out[-4000:]  # the killed save's restart
    assert out.count("[test] killed worker") == 2, seed + out[-4000:]
    assert len(resumes) == 3, seed + out[-4000:]  # each random kill landed mid-training: its restart resumed
    # the kill mid-save fails the group's collective and torchrun's SIGTERM reaches rank 0 as its
    # error unwinds: its line names the step and the newest snapshot, not a start-up
    assert "during start-up" not in out, seed + out[-4000:]
    assert not list(snaps.glob(".tmp-*")), seed + str(sorted(p.name for p in snaps.iterdir()))
    try:
        assert_bit_identical(long_ddp_reference, run)
    except AssertionError as e:
        raise AssertionError(seed + str(e)) from None
    steps = metric_steps(run)
    assert steps == sorted(set(steps)) == metric_steps(long_ddp_reference), (seed, steps)
