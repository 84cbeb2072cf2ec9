"""Stopping safely: a Ctrl-C (SIGINT to the whole
process group, as a terminal sends it) or a SIGTERM to one worker stops every rank at one step with
one snapshot of it, also when a second SIGTERM lands in the middle of that snapshot's write; the job
prints one closing line naming the snapshot and the command that resumes, and no traceback of ours;
running that command ends bit-identical. A signal during start-up is one line too. A non-finite loss
or weight at a step that is not logged is never snapshotted and stops the run with one line."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launch.stopping as stopping
import main as app
from checks import load_config
from conftest import LONG_DDP_REFERENCE
from harness import StreamedLaunch, metric_steps, model_tensors
from launch.build import build_trainer
from launch.stopping import torchrun_command
from parallel.env import init_distributed
from testing import faults
from testing.local import REPO, TINY, child_env, multiprocess_lock, rank_pid, torchrun, torchrun_argv, worker_pids

# save_every=0: the only snapshots are the stop snapshots and the final one, so a relaunch can only
# resume from what the stop wrote.
STOP = LONG_DDP_REFERENCE + ["trainer.save_every=0"]
STOP_LINE = re.compile(r"^stopped by (SIGTERM|SIGINT) at step (\d+): saved (\S+); to resume: (.+)$", re.M)
START_LINE = re.compile(r"^stopped by (SIGINT|SIGTERM) during start-up: this launch saved nothing; to relaunch: (.+)$",
                        re.M)
TORCHRUN = torchrun_argv(2, [])


def snapshots(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "snapshots").iterdir())


def launch(cmd: list[str], signal_to: str | None, when: str | Path = "training", **env) -> tuple[int, str]:
    """Run `cmd` (torchrun or `python main.py`) in a process group of its own, as a shell runs a
    job, and signal it once the first progress line shows training (when="training") or while its
    processes import torch (when="start-up") or once the file `when` exists: 'group' = SIGINT to the whole group, as a terminal's
    Ctrl-C does; 'agent' = SIGTERM to torchrun only, as SLURM or Kubernetes may send it; 'rank1' =
    SIGTERM to that torchrun worker only. Returns (exit code, stdout + stderr)."""
    with StreamedLaunch(cmd, **env) as job:
        if signal_to is not None:
            ready = job.wait_for(lambda: any(l.startswith("step ") for l in job.lines) if when == "training"
                                 else importing_torch(job.proc.pid, cmd[1] == "-m") if when == "start-up"
                                 else Path(when).exists())
            assert ready and job.proc.poll() is None, job.output()[-3000:]
            if signal_to == "group":
                os.killpg(job.proc.pid, signal.SIGINT)
            elif signal_to == "agent":
                os.kill(job.proc.pid, signal.SIGTERM)
            else:
                os.kill(rank_pid(job.proc.pid, 1), signal.SIGTERM)
        rc = job.proc.wait(timeout=200)
    return rc, job.output()


def importing_torch(pid: int, torchrun: bool) -> bool:
    """True once every process of the launch (torchrun's 2 workers, or the one process) has
    loaded libtorch: they are in `import torch`, seconds before training could start."""
    pids = worker_pids(pid) if torchrun else [pid]
    try:
        return len(pids) == (2 if torchrun else 1) and all(
            "libtorch_cpu" in Path(f"/proc/{p}/maps").read_text() for p in pids)
    except OSError:
        return False


def assert_no_traceback_of_ours(out: str, torchrun: bool) -> None:
    """Our processes print no traceback. torchrun's agent, when it gets the signal itself, always
    prints its own (SignalException, raised by its signal handler; see the README)."""
    assert "KeyboardInterrupt" not in out and 'main.py", line' not in out, out[-4000:]
    if torchrun:
        assert out.count("Traceback (most recent call last)") == 1, out[-4000:]
        assert re.search(r"SignalException: Process \d+ got signal: \d+$", out.rstrip()), out[-4000:]
    else:
        assert "Traceback" not in out, out[-4000:]


def stop_of(out: str) -> tuple[int, str, list[str]]:
    """The one closing line of a job stopped during training: (step, snapshot, resume command)."""
    found = STOP_LINE.findall(out)
    assert len(found) == 1, out[-4000:]  # one closing line per job, not one per rank
    assert not START_LINE.search(out), out[-4000:]
    return int(found[0][1]), found[0][2], shlex.split(found[0][3])


@pytest.mark.launch
def test_ctrl_c_or_sigterm_stops_at_one_step_saves_it_and_the_printed_command_resumes(long_ddp_reference,
                                                                                      tmp_path):
    reference, run = long_ddp_reference, tmp_path / "run"

    # (a) Ctrl-C: SIGINT to the whole process group mid-run (torchrun's agent and both workers).
    cmd_a = [*TORCHRUN, "main.py", *STOP, f"trainer.run_dir={run}"]
    rc, out = launch(cmd_a, "group")
    step_a, path_a, resume_a = stop_of(out)
    assert "stopped by SIGINT" in out and resume_a == cmd_a, out[-4000:]
    assert 0 < step_a < 120, out[-4000:]
    assert snapshots(run) == [f"step_{step_a:07d}"] and Path(path_a) == run / "snapshots" / snapshots(run)[0]
    assert rc == 1  # torchrun re-raises the signal it got (SignalException): the job did not finish
    assert_no_traceback_of_ours(out, torchrun=True)
    assert not (run / "model.pt").exists()  # a stop is not the end of training

    # (b) SIGTERM to rank 1 only, (c) and a second SIGTERM to rank 0 in the middle of the stop
    # snapshot's write. --max-restarts=1: the workers exit 0, so the agent must not restart them.
    cmd_b = [*TORCHRUN, "--max-restarts=1", "--monitor-interval=0.2", "main.py", *STOP, f"trainer.run_dir={run}"]
    rc, out = launch(cmd_b, "rank1", MINGPT_FAULT="term:save:*:0")
    assert rc == 0, out[-4000:]
    assert "[fault] rank 0 sends itself SIGTERM at save" in out, out[-4000:]
    assert out.count("resumed from") == 1, out[-4000:]  # this launch's own resume; no restart
    step_b, path_b, resume_b = stop_of(out)
    assert "stopped by SIGTERM" in out and resume_b == cmd_b and "Traceback" not in out, out[-4000:]
    assert step_a < step_b < 120, out[-4000:]
    assert snapshots(run) == [f"step_{step_a:07d}", f"step_{step_b:07d}"], out[-4000:]

    # the printed command, run as printed, resumes from the stop snapshot and ends as if nothing happened
    with multiprocess_lock():
        r = subprocess.run(resume_b, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"step_{step_b:07d} at step {step_b}" in r.stdout
    ta, tb = model_tensors(reference), model_tensors(run)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert metric_steps(run) == metric_steps(reference)


@pytest.mark.launch
def test_ctrl_c_to_python_main_py_stops_saves_and_the_printed_command_resumes(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "main.py", *STOP, "parallel.strategy=none", "trainer.resume=never",
           f"trainer.run_dir={run}"]
    rc, out = launch(cmd, "group")
    assert rc == 128 + signal.SIGINT, out[-4000:]  # as a shell reports a job ended by Ctrl-C
    step, path, resume = stop_of(out)
    assert_no_traceback_of_ours(out, torchrun=False)
    assert snapshots(run) == [f"step_{step:07d}"] and Path(path) == run / "snapshots" / snapshots(run)[0]
    # trainer.resume=never would refuse the folder it just filled: the printed command resumes
    assert resume == [*cmd, "trainer.resume=auto"], out[-4000:]
    r = subprocess.run(resume, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=200)
    assert r.returncode == 0 and f"resumed from {path} at step {step}" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.rstrip().splitlines()[-1].startswith("done: step 120"), r.stdout[-2000:]


@pytest.mark.launch
def test_sigterm_to_python_main_py_saves_and_exits_143(tmp_path):
    """The exit table's 143: a SIGTERM to `python main.py` mid-training (as a scheduler sends it)
    stops at one step, saves it and ends as a shell reports a job ended by SIGTERM. (The resume of
    such a stop is the Ctrl-C test's above: the same code after the signal is recorded.)"""
    run = tmp_path / "run"
    with StreamedLaunch([sys.executable, "main.py", *STOP, "parallel.strategy=none", f"trainer.run_dir={run}"]) as job:
        assert job.wait_for(lambda: any(l.startswith("step ") for l in job.lines)), job.output()[-3000:]
        os.kill(job.proc.pid, signal.SIGTERM)
        rc = job.proc.wait(timeout=200)
    out = job.output()
    assert rc == 128 + signal.SIGTERM, out[-4000:]
    step, path, _ = stop_of(out)
    assert STOP_LINE.search(out).group(1) == "SIGTERM" and Path(path) == run / "snapshots" / f"step_{step:07d}"
    assert_no_traceback_of_ours(out, torchrun=False)


@pytest.mark.launch
def test_a_signal_during_start_up_is_one_line_and_no_traceback(tmp_path):
    """Ctrl-C (or torchrun's forwarded SIGTERM) while the processes still import torch: before the
    step loop there is no step to agree on, so every process ends by the signal at once (a shell
    shows 128 + signal; subprocess -signal); the job prints one line."""
    for i, (cmd, target, code) in enumerate((
            ([*TORCHRUN, "main.py", *STOP], "group", 1),
            ([*TORCHRUN, "main.py", *STOP], "agent", 1),
            ([sys.executable, "main.py", *STOP, "parallel.strategy=none"], "group", -signal.SIGINT))):
        run = tmp_path / f"run{i}"
        cmd = [*cmd, f"trainer.run_dir={run}"]
        rc, out = launch(cmd, target, when="start-up")
        assert rc == code, out[-4000:]
        found = START_LINE.findall(out)
        assert len(found) == 1 and found[0][0] == ("SIGINT" if target == "group" else "SIGTERM"), out[-4000:]
        assert shlex.split(found[0][1]) == cmd, out[-4000:]
        assert_no_traceback_of_ours(out, torchrun=cmd[1] == "-m")
        assert not STOP_LINE.search(out) and not (run / "snapshots").exists(), out[-4000:]


@pytest.mark.launch
def test_ctrl_c_after_training_is_one_line_naming_the_final_snapshot(tmp_path):
    """SIGINT while the finished run writes its sample (model.pt is written just before): the final
    snapshot is in place, so the line says so and how to write model.pt, instead of a traceback."""
    run = tmp_path / "run"
    cmd = [sys.executable, "main.py", *STOP, "parallel.strategy=none", "trainer.max_steps=20",
           "trainer.sample_tokens=20000", f"trainer.run_dir={run}"]
    rc, out = launch(cmd, "group", when=run / "model.pt")
    assert rc == -signal.SIGINT, out[-4000:]  # ended by the signal: a shell shows 130
    assert_no_traceback_of_ours(out, torchrun=False)
    lines = [l for l in out.splitlines() if l.startswith("stopped by")]
    assert lines == [f"stopped by SIGINT after training: saved {run / 'snapshots' / 'step_0000020'}, but "
                     f"model.pt or sample.txt may be missing; to write model.pt: python export.py --run-dir {run}"], out
    assert snapshots(run) == ["step_0000020"] and not (run / "sample.txt").exists()


def test_the_resume_command_is_read_from_torchrun_as_it_was_typed():
    """The launches above run `python -m torch.distributed.run`; the `torchrun` script runs as its
    shebang's interpreter + the script's path; any other parent gives no command."""
    args = ["--nproc_per_node=2", "main.py", "trainer.run_dir=runs/x y"]
    assert torchrun_command(["/venv/bin/python3.11", "/venv/bin/torchrun", *args]) == ["torchrun", *args]
    assert torchrun_command(["python3", "-u", "-m", "torch.distributed.run", *args]) == \
        ["python3", "-u", "-m", "torch.distributed.run", *args]
    assert torchrun_command(["python", "-m", "other.launcher", *args]) is None
    assert torchrun_command(["/usr/sbin/slurmstepd"]) is None


# main.py as a shell runs it (`__main__`, its pre-torch handlers), then a SIGTERM to the process once
# main() has returned: the window in which an erroring torchrun worker unwinds and prints its error
# while the agent's SIGTERM arrives.
SIGNAL_AFTER_MAIN = """
import os, runpy, signal, sys
sys.argv[0] = "main.py"
try:
    runpy.run_path("main.py", run_name="__main__")
except SystemExit as e:
    print(f"[test] main.py exited {e.code}", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
"""


@pytest.mark.launch
def test_a_signal_after_the_launch_ended_is_not_called_a_start_up(tmp_path):
    """A SIGTERM that lands after main() has returned, while the process ends (a peer killed
    mid-save: this rank's collective fails, its error unwinds, then torchrun's SIGTERM arrives). A
    launch that ended by an error after its step loop began: the line names the step it reached
    and the newest snapshot a relaunch resumes from. A launch that finished: nothing more is said.
    Either way the process ends by the signal."""
    def after_main(run: Path, *overrides: str, **env) -> tuple[int, str]:
        r = subprocess.run([sys.executable, "-c", SIGNAL_AFTER_MAIN, *NAN, "parallel.strategy=none",
                            f"trainer.run_dir={run}", *overrides],
                           cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=200)
        return r.returncode, r.stdout + r.stderr

    failed = tmp_path / "failed"
    rc, out = after_main(failed, MINGPT_FAULT="nan:update:4:0")  # the weights turn NaN in step 4's update
    assert rc == -signal.SIGTERM and "\n[test] main.py exited 1\n" in out, out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("stopped by")]
    assert len(lines) == 1 and not START_LINE.search(out), out[-4000:]
    assert lines[0].startswith(f"stopped by SIGTERM at step 4, outside a step (after an error): the newest "
                               f"snapshot is {failed / 'snapshots' / 'step_0000002'}; to resume: "), lines

    done = tmp_path / "done"
    rc, out = after_main(done, "trainer.max_steps=2")
    assert rc == -signal.SIGTERM and "\n[test] main.py exited 0\n" in out, out[-4000:]
    assert "done: step 2" in out and "stopped by" not in out, out[-4000:]


SIGNAL_WHILE_REPORTING = """
import signal, sys
import main
main.error_line = lambda e: signal.raise_signal(signal.SIGTERM)  # the signal lands as the error is reported
sys.exit(main.main(sys.argv[1:]))
"""


@pytest.mark.launch
def test_a_signal_while_an_error_is_reported_is_one_line_not_a_traceback(tmp_path):
    """A SIGTERM that lands while main() reports a launch's error (its peer died, torchrun's
    SIGTERM follows): one closing line and the process ends by the signal, no traceback. Here the
    error is a bad override, so the line is a start-up's."""
    r = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_REPORTING, *TINY, "trainer.no_such_key=1",
                        f"trainer.run_dir={tmp_path / 'run'}"],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode == -signal.SIGTERM and "Traceback" not in out, out[-3000:]
    assert len(START_LINE.findall(out)) == 1, out[-3000:]


# ----------------------------------------------------------------------------- non-finite

# log_every=5: step 4 is a save step that is not a log step; keep_snapshots=1, so a NaN snapshot
# at step 4 would prune the good one at step 2.
NAN = TINY + ["trainer.sample_tokens=0", "trainer.max_steps=10", "trainer.save_every=2",
              "trainer.keep_snapshots=1"]


def test_nan_weights_in_one_process_are_never_snapshotted(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    args = NAN + ["parallel.strategy=none", f"trainer.run_dir={run}"]
    monkeypatch.setenv("MINGPT_FAULT", "nan:update:4:0")  # the weights turn NaN in step 4's update
    faults.install()  # this process runs the app: its hook points get the faults here
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


@pytest.mark.launch
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
    trainer = build_trainer(cfg, init_distributed(cfg), run)
    # creates the scale tensor on the training device, then make it overflow fp16. A scale on the CPU
    # beside a GPU's gradients is a race: GradScaler copies the GPU's inf verdict to the scale's device
    # with non_blocking=True before the step reads it (an H200 took the step once, and the loss went NaN).
    trainer.scaler.scale(torch.ones((), device=trainer.strategy.device))
    trainer.scaler.update(new_scale=2.0**100)
    assert trainer.train().final_step == 4
    assert trainer.scaler.get_scale() == 2.0**96  # all 4 steps had inf gradients and were skipped
    assert snapshots(run) == ["step_0000004"]


def test_a_signal_after_training_began_names_its_step_and_snapshot_not_a_start_up(tmp_path):
    """A stop signal that reaches a rank while an error unwinds it out of the step loop (a peer
    killed mid-save: the collective fails, then torchrun's SIGTERM arrives) is reported by main.py
    from what the launch recorded when its loop began: the step it reached and the newest snapshot
    a relaunch resumes from. Here a launch trains 4 steps; its record then reads as that signal's
    line would."""
    run = tmp_path / "run"
    assert app.main(TINY + ["parallel.strategy=none", "trainer.max_steps=4", "trainer.save_every=2",
                            "trainer.sample_tokens=0", f"trainer.run_dir={run}"]) == 0
    step, newest = stopping.training_progress()
    assert step == 4 and Path(newest) == run / "snapshots" / "step_0000004", (step, newest)
    line = stopping.interrupted_line(signal.SIGTERM, "torchrun main.py", training=(step, newest))
    assert line == (f"stopped by SIGTERM at step 4, outside a step (after an error): the newest snapshot is "
                    f"{newest}; to resume: torchrun main.py"), line
    stopping.training_began(None)
    assert "during start-up" in stopping.interrupted_line(signal.SIGTERM, None, training=stopping.training_progress())
