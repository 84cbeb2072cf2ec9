"""Storage faults lose nothing: a snapshot save the storage refuses (a full disk, an I/O error, a
filesystem turned read-only, no permission) leaves every older snapshot valid, leaves nothing
that looks like a snapshot, and stops every rank with one line naming the error, the folder, the
snapshot that stays the resume point and the fix (exit 3); once fixed, a relaunch of the same
command ends bit-identical to an uninterrupted run. model.pt and sample.txt at the end of a run
are one warning, and export.py rebuilds model.pt from the final snapshot.

Each fault is real: a size-limited tmpfs (ENOSPC; also one filled by another writer mid-run, which
the metrics row meets first), `mount -o remount,ro` mid-save (EROFS), a
process without the capabilities that let root ignore permissions (EACCES), and the `eio` fault
hook inside one rank's DCP write (EIO, which this machine cannot cause for real). Mounting needs
root, as CI has, or a user and mount namespace, where any user is root of its own mounts:
`unshare -Urm python -m pytest tests/test_storage_faults.py` (where the system allows
unprivileged user namespaces). Anyone else gets one failing line per test saying so, never a skip.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import export
import main as app
import trainer as trainer_module
from observe import hooks
from snapshots.store import list_snapshots, validate_snapshot
from testing.local import REPO, TINY, child_env, torchrun

pytestmark = pytest.mark.launch
NEEDS_ROOT = ("the storage-fault tests mount tmpfs filesystems: run them as root, or in a user and mount "
              "namespace: unshare -Urm python -m pytest tests/test_storage_faults.py (needs unprivileged "
              "user namespaces: sysctl user.max_user_namespaces > 0)")

# Snapshots every 5 steps; the cosine's length is fixed, so a run resumed at any step follows the
# same LR curve as the uninterrupted one. A snapshot of this model takes about 1.1 MiB.
COMMON = TINY + ["trainer.max_steps=20", "trainer.save_every=5", "optimizer.lr_decay_steps=20"]
SINGLE = COMMON + ["parallel.strategy=none"]
DDP = COMMON + ["parallel.strategy=ddp"]
RESTART = ["--max-restarts=1", "--monitor-interval=0.2"]


@pytest.fixture(autouse=True, scope="session")  # session: set up before the session's ddp_reference launch
def _root_of_its_mounts():
    """Root, or root of a user namespace (unshare -Urm): else each test fails with NEEDS_ROOT."""
    if os.geteuid() != 0:
        pytest.fail(NEEDS_ROOT, pytrace=False)


@contextmanager
def tmpfs(where: Path, size: str):
    """A real filesystem of `size` at `where`, unmounted (lazily, if still busy) at the end."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)]).returncode != 0:
            subprocess.run(["umount", "-l", str(where)])


def remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def model_tensors(path: Path) -> dict:
    return torch.load(path, weights_only=True)["model"]


def assert_bit_identical(a: Path, b: Path) -> None:
    ta, tb = model_tensors(a), model_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"{k} differs: max {(ta[k] - tb[k]).abs().max().item():.3e}"


def assert_only_valid_snapshots(run: Path, steps: list[int]) -> None:
    """The snapshots a resume sees are exactly `steps`, each complete and matching its checksums."""
    found = list_snapshots(run / "snapshots")
    assert [int(p.name[5:]) for p in reversed(found)] == steps, found
    for p in found:
        assert validate_snapshot(p)[0] is not None, validate_snapshot(p)[1]


def metric_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def storage_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("error: cannot write")]
    assert len(lines) >= 1, out[-4000:]
    return lines[0]


def no_traceback_but_torchruns(out: str) -> bool:
    """No worker printed a traceback: the only one is the agent's own ChildFailedError, which
    torchrun prints whenever a worker exits non-zero (torch/distributed/run.py does not catch it)."""
    return out.count("Traceback") == out.count("ChildFailedError: ") <= 1


@pytest.fixture(scope="module")
def single_uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("single") / "run"
    assert app.main(SINGLE + [f"trainer.run_dir={run}"]) == 0
    return run


def test_full_disk_under_torchrun_stops_every_rank_and_a_relaunch_after_freeing_space_matches(
        ddp_reference, tmp_path):
    """2 ranks on a 3 MB tmpfs: snapshots 5 and 10 fit, 15 does not. Both ranks stop with the one
    line (exit 3, no traceback, no hang); the restart that --max-restarts makes stops at start-up
    (the disk is still full) instead of training up to the same save; after `remount,size=64m`
    the same command ends bit-identical to the uninterrupted run (ddp_reference, which saves in the
    background: these synchronous saves train the same model)."""
    with tmpfs(tmp_path / "disk", "3m") as disk:
        run = disk / "run"
        cmd = ["main.py", *DDP, f"trainer.run_dir={run}"]
        r = torchrun(2, cmd, timeout=240, extra_torchrun=RESTART)
        out = r.stdout + r.stderr
        assert r.returncode == 1, out[-4000:]  # torchrun's own code when its workers fail
        snaps = run / "snapshots"
        assert storage_line(r.stderr) == (
            f"error: cannot write snapshot step 15 to {snaps} (No space left on device); nothing was lost: "
            f"the newest valid snapshot {snaps / 'step_0000010'} stays the resume point; free space and "
            f"relaunch the same command"), out[-4000:]
        assert re.search(rf"error: cannot write the next snapshot to {re.escape(str(snaps))} \(No space left "
                         rf"on device: [\d.]+ MiB free, a snapshot takes [\d.]+ MiB\); nothing was lost", out), out[-4000:]
        assert "exitcode  : 3" in r.stderr and no_traceback_but_torchruns(out), out[-4000:]
        assert_only_valid_snapshots(run, [5, 10])
        assert not list(snaps.glob(".tmp-*"))  # the failed save's partial files are gone

        remount(disk, "size=64m")
        r = torchrun(2, cmd, timeout=240)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert f"resumed from {snaps / 'step_0000010'} at step 10" in r.stdout, r.stdout[-2000:]
        assert_bit_identical(ddp_reference / "model.pt", run / "model.pt")


def test_io_error_on_one_rank_stops_both_and_the_restart_finishes(ddp_reference, tmp_path):
    """`eio:save:10:1`: only rank 1's write of snapshot 10 fails (EIO inside DCP's file write).
    Rank 0, whose own files were written, stops with the same line; torchrun's restart (an I/O
    error may be transient) resumes from step 5 and ends bit-identical."""
    run = tmp_path / "run"
    r = torchrun(2, ["main.py", *DDP, f"trainer.run_dir={run}"], timeout=300, extra_torchrun=RESTART,
                 MINGPT_FAULT="eio:save:10:1")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    snaps = run / "snapshots"
    assert storage_line(r.stderr) == (
        f"error: cannot write snapshot step 10 to {snaps} (Input/output error); nothing was lost: the "
        f"newest valid snapshot {snaps / 'step_0000005'} stays the resume point; check the storage (an I/O "
        f"error: a failing disk or a lost network mount) and relaunch the same command"), out[-4000:]
    assert no_traceback_but_torchruns(out) and f"resumed from {snaps / 'step_0000005'} at step 5" in r.stdout, out[-4000:]
    assert_bit_identical(ddp_reference / "model.pt", run / "model.pt")


def test_filesystem_turning_read_only_mid_save_then_relaunch_matches(single_uninterrupted, tmp_path,
                                                                    monkeypatch, capsys):
    """The snapshots' filesystem (its own mount: a busy filesystem cannot be remounted read-only,
    and the run folder holds the launch lock open) turns read-only after snapshot 10's shards are
    written, before its meta.json: one line, exit 3, snapshot 5 stays the resume point; a relaunch
    while it is read-only stops at start-up; remounted read-write, the same command resumes from 5
    and ends bit-identical."""
    run = tmp_path / "run"
    snaps = run / "snapshots"

    def read_only_at_save_10(where, step, rank):
        if where == "save" and step == 10:
            remount(snaps, "ro")

    with tmpfs(snaps, "64m"):
        monkeypatch.setitem(hooks.HANDLERS, "save", read_only_at_save_10)
        assert app.main(SINGLE + [f"trainer.run_dir={run}"]) == 3
        err = capsys.readouterr().err
        assert storage_line(err) == (
            f"error: cannot write snapshot step 10 to {snaps} (Read-only file system); nothing was lost: the "
            f"newest valid snapshot {snaps / 'step_0000005'} stays the resume point; make the filesystem "
            f"writable again (remount it read-write) and relaunch the same command"), err[-3000:]
        assert "Traceback" not in err
        assert_only_valid_snapshots(run, [5])

        monkeypatch.delitem(hooks.HANDLERS, "save")
        assert app.main(SINGLE + [f"trainer.run_dir={run}"]) == 3
        out, err = capsys.readouterr()
        assert storage_line(err).startswith(f"error: cannot write the next snapshot to {snaps} (Read-only file "
                                            f"system); nothing was lost"), err[-3000:]
        assert "step " not in out + err.replace(storage_line(err), ""), out + err

        remount(snaps, "rw")
        assert app.main(SINGLE + [f"trainer.run_dir={run}"]) == 0
        assert f"resumed from {snaps / 'step_0000005'} at step 5" in capsys.readouterr().out
        assert not list(snaps.glob(".tmp-*"))
        assert_bit_identical(single_uninterrupted / "model.pt", run / "model.pt")


# Run as root without the capabilities that let root ignore file permissions (DAC override and
# read-search, owner override): the permission checks of any other user. A plain setuid to
# `nobody` cannot run this Python, which lives under /root (mode 700) here.
_PR_CAPBSET_DROP = 24
_PERMISSION_CAPS = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


def _without_permission_override():
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in _PERMISSION_CAPS:  # dropped from the bounding set: exec grants root only what is left
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


# The run loses write permission on its snapshots folder while snapshot 10 is being written.
_CHMOD_AT_SAVE_10 = """
import os, sys
import main
from observe import hooks
def chmod_at_save(where, step, rank):
    if where == "save" and step == 10:
        os.chmod(os.environ["SNAPSHOTS"], 0o555)
hooks.install("save", chmod_at_save)
sys.exit(main.main(sys.argv[1:]))
"""


def unprivileged(args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=child_env(**env), capture_output=True,
                          text=True, timeout=300, preexec_fn=_without_permission_override)


def test_permission_lost_mid_save_and_a_relaunch_without_it_stops_at_start(tmp_path):
    """Without permission to write the snapshots folder, snapshot 10 fails (EACCES at its rename):
    one line, exit 3, snapshot 5 stays; a relaunch still without it stops at start-up with the
    same kind of line, before training a step."""
    run = tmp_path / "run"
    snaps = run / "snapshots"
    args = SINGLE + [f"trainer.run_dir={run}"]
    try:
        r = unprivileged(["-c", _CHMOD_AT_SAVE_10, *args], SNAPSHOTS=str(snaps))
        assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
        assert storage_line(r.stderr) == (
            f"error: cannot write snapshot step 10 to {snaps} (Permission denied); nothing was lost: the "
            f"newest valid snapshot {snaps / 'step_0000005'} stays the resume point; give this user write "
            f"permission on {snaps} and relaunch the same command"), r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        assert_only_valid_snapshots(run, [5])

        r = unprivileged(["main.py", *args])
        assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
        assert storage_line(r.stderr).startswith(f"error: cannot write the next snapshot to {snaps} "
                                                 f"(Permission denied); nothing was lost"), r.stderr[-3000:]
        assert "step " not in r.stdout and "Traceback" not in r.stderr, r.stdout[-2000:]
    finally:
        snaps.chmod(0o755)


def fill(disk: Path) -> Path:
    """Write zeros into `disk` until it is full; the file to delete to free the space again."""
    filler, block = disk / "filler", bytes(1 << 16)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError:
            pass
    return filler


def test_disk_filled_by_another_writer_mid_run_then_relaunch_matches(single_uninterrupted, tmp_path,
                                                                    monkeypatch, capsys):
    """Something else fills the disk after step 8: the metrics row of step 10 is one warning (only
    the tracker rank writes rows), the save of step 10 stops the run with the one line (exit 3);
    with the space freed the same command ends bit-identical, every metrics row once."""
    fillers = []

    def fill_at_step_8(step, rank, module):
        if step == 8 and not fillers:
            # metrics.jsonl ends on a page boundary (blank lines, which a resume drops), so its next
            # row needs a page the full disk no longer has, as a longer history would
            metrics = run / "metrics.jsonl"
            with open(metrics, "a") as f:
                f.write("\n" * (-metrics.stat().st_size % 4096))
            fillers.append(fill(disk))

    with tmpfs(tmp_path / "disk", "64m") as disk:
        run = disk / "run"
        snaps = run / "snapshots"
        monkeypatch.setitem(hooks.HANDLERS, "update", fill_at_step_8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert app.main(SINGLE + [f"trainer.run_dir={run}"]) == 3
        ours = [str(w.message) for w in caught if "metrics row" in str(w.message)]
        assert ours == [f"the metrics row of step 10 cannot be written to {run} (No space left on device); "
                        f"training goes on, and a snapshot the storage refuses stops the run"], ours
        err = capsys.readouterr().err
        assert storage_line(err) == (
            f"error: cannot write snapshot step 10 to {snaps} (No space left on device); nothing was lost: the "
            f"newest valid snapshot {snaps / 'step_0000005'} stays the resume point; free space and relaunch "
            f"the same command"), err[-3000:]
        assert "Traceback" not in err
        assert_only_valid_snapshots(run, [5])

        monkeypatch.delitem(hooks.HANDLERS, "update")
        fillers[0].unlink()
        assert app.main(SINGLE + [f"trainer.run_dir={run}"]) == 0
        assert_bit_identical(single_uninterrupted / "model.pt", run / "model.pt")
        assert metric_steps(run) == metric_steps(single_uninterrupted) == [5, 10, 15, 20]


def test_a_disk_full_before_the_first_snapshot_is_the_storage_line_and_changes_nothing(
        single_uninterrupted, tmp_path, capsys):
    """A fresh run on a disk that is already full: its first files (tokenizer.json, config.yaml)
    cannot be written. One line, exit 3, no traceback, no half file; with space freed the same
    command ends bit-identical."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        run = disk / "run"
        filler = fill(disk)
        assert app.main(SINGLE + [f"trainer.run_dir={run}"]) == 3
        err = capsys.readouterr().err
        assert storage_line(err) == (
            f"error: cannot write the run's first files (tokenizer.json, config.yaml) to {run} (No space left on "
            f"device); no valid snapshot exists yet, so a relaunch starts again from step 0; free space and "
            f"relaunch the same command"), err[-3000:]
        assert "Traceback" not in err
        assert not run.exists()  # the folder this launch created is removed with its lock
        filler.unlink()
        assert app.main(SINGLE + [f"trainer.run_dir={run}"]) == 0
        assert_bit_identical(single_uninterrupted / "model.pt", run / "model.pt")


def test_outputs_on_a_full_disk_are_one_warning_and_export_rebuilds_model_pt(
        single_uninterrupted, tmp_path, monkeypatch, capsys):
    """The disk fills after the final snapshot: model.pt and sample.txt are one warning naming the
    final snapshot and export.py (the run is complete: exit 0), no half file; export.py on the full
    disk is one line (exit 3); with space freed it writes model.pt bit-identical to the
    uninterrupted run's."""
    real = trainer_module.Trainer.write_model
    fillers = []

    def fill_then_write(self, path, sd):
        fillers.append(fill(path.parent))
        return real(self, path, sd)

    with tmpfs(tmp_path / "disk", "64m") as disk:
        run = disk / "run"
        monkeypatch.setattr(trainer_module.Trainer, "write_model", fill_then_write)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert app.main(SINGLE + [f"trainer.run_dir={run}"]) == 0
        final = run / "snapshots" / "step_0000020"
        ours = [str(w.message) for w in caught if "after training" in str(w.message)]
        assert ours == [f"model.pt and sample.txt could not be written after training (OSError: No space left "
                        f"on device); the run itself is complete: its final snapshot {final} holds the weights, "
                        f"and python export.py --run-dir {run} writes model.pt from it"], ours
        assert "done: step 20" in capsys.readouterr().out
        assert sorted(p.name for p in run.iterdir() if p.is_file()) == [
            "config.yaml", "filler", "launch.lock", "metrics.jsonl", "tokenizer.json", "tracker.json"]

        assert export.main(["--run-dir", str(run)]) == 3
        err = capsys.readouterr().err
        assert err == (f"error: cannot write {run / 'model.pt'} (No space left on device); nothing was written; "
                       f"free space and run this command again\n"), err
        assert not (run / "model.pt").exists()
        hf = run / "hf"  # the Hugging Face folder on the full disk: the same line, no half file
        assert export.main(["--run-dir", str(run), "--format", "hf", "--out", str(hf)]) == 3
        err = capsys.readouterr().err
        assert err == (f"error: cannot write {hf} (No space left on device); each of its files is whole or "
                       f"absent; free space and run this command again\n"), err
        assert list(hf.iterdir()) == []  # its first file already met the full disk
        fillers[0].unlink()
        assert export.main(["--run-dir", str(run)]) == 0
        assert_bit_identical(single_uninterrupted / "model.pt", run / "model.pt")
