"""The run folder: one launch per run folder, held by an OS lock that dies
with its process; a refused launch changes no file of the folder; an impossible or unwritable
run_dir is one line and exit 2.

Launches: one `python main.py` (the running launch that a second one runs into) and one 2-process
tests/app_worker.py (the refusal of a whole job); everything else runs in this process."""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# main imports every module of the app at its top, so a forked child that dropped its privileges
# (and can no longer read the Python installation) has them already
import main as app
from config import UsageError
from launch import runlock
from testing.local import REPO, TINY, child_env, torchrun

RUN = TINY + ["parallel.strategy=none", "trainer.sample_tokens=0", "trainer.save_every=2"]


def listing(folder: Path) -> dict:
    """Every entry of the folder: kind, size, mtime (ns), inode and the content's sha256. A file
    rewritten with the same bytes still shows (new mtime, or a new inode after os.replace)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(folder))] = (digest, st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def one_error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ----------------------------------------------------------------------------- the lock


@pytest.mark.launch
def test_second_launch_is_refused_and_the_lock_dies_with_its_process(tmp_path, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "main.py", *RUN, "trainer.max_steps=100000",
                              f"trainer.run_dir={run}"], cwd=REPO, env=child_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (run / "snapshots" / "step_0000002").is_dir():
            assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.02)
        # the first launch holds the lock; frozen, it writes nothing while we look
        first.send_signal(signal.SIGSTOP)
        before = listing(run)

        # a second launch, same config: refused, one line, exit 2, nothing touched
        capsys.readouterr()
        assert app.main(RUN + ["trainer.max_steps=1", f"trainer.run_dir={run}"]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "is in use by another launch" in line and "launch.lock" in line, line
        assert listing(run) == before

        # a second job: rank 0 refuses and rank 1 with it. tests/app_worker.py runs main() twice in
        # one process group; a rank 1 that went on into the first run would never meet rank 0 in
        # the second one (it would hang until the process-group timeout)
        job = RUN + ["parallel.strategy=ddp", "trainer.max_steps=1"]
        r = torchrun(2, ["tests/app_worker.py", "--out", str(tmp_path),
                         "--app", " ".join(job + [f"trainer.run_dir={run}"]),
                         "--app", " ".join(job + [f"trainer.run_dir={tmp_path / 'other'}"])], timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert json.loads((tmp_path / "exit_codes.json").read_text()) == [2, 0]
        errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert len(errors) == 1 and "is in use by another launch" in errors[0], r.stderr[-3000:]
        assert listing(run) == before

        # SIGKILL the holder: the kernel drops its lock, and the next launch resumes
        first.kill()
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)
    newest = max(int(p.name[5:]) for p in (run / "snapshots").glob("step_*"))
    capsys.readouterr()
    assert app.main(RUN + [f"trainer.max_steps={newest + 2}", f"trainer.run_dir={run}"]) == 0
    assert f"at step {newest}" in capsys.readouterr().out


def hold_lock(path: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the flock on `path` for `seconds` (a lost node's lock on a network
    filesystem, which lives until the server's lease expires), started and holding on return."""
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(float(sys.argv[2]))")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.launch
def test_a_torchrun_restart_waits_for_a_lock_that_outlives_its_holder(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    holder = hold_lock(run / runlock.LOCK_FILE, 120)
    try:
        # a first launch never waits: a folder in use is another job's (it would say so: the restart
        # below shows the line a wait prints; its duration is no test's business)
        assert runlock.restart_lock_wait() == 0
        assert app.main(RUN + ["trainer.max_steps=1", f"trainer.run_dir={run}"]) == 2
        err = capsys.readouterr().err
        assert "is in use by another launch" in one_error_line(err) and "waiting up to" not in err, err
        # a restart (what torchrun sets for a restarted worker) waits, says so once, then trains once
        # the holder is gone (it ends only after the restart said it waits: no race with a slow start)
        restart = subprocess.Popen([sys.executable, "main.py", *RUN, "trainer.max_steps=1", f"trainer.run_dir={run}"],
                                   cwd=REPO, env=child_env(TORCHELASTIC_RESTART_COUNT=1), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        said = ""
        while "waiting up to 150 s for the lock" not in said and (line := restart.stderr.readline()):
            said += line
        holder.kill()
        err = said + restart.communicate(timeout=120)[1]
        assert restart.returncode == 0, err[-3000:]
        assert err.count("waiting up to 150 s for the lock") == 1, err[-3000:]
        assert (run / "snapshots" / "step_0000001").is_dir()
    finally:
        holder.kill()
    # a lock still held when the wait ends: refused with the usual line
    holder = hold_lock(run / runlock.LOCK_FILE, 30)
    try:
        t0 = time.monotonic()
        with pytest.raises(UsageError, match="is in use by another launch"):
            runlock.RunLock(run).acquire(wait_s=1.5)
        assert time.monotonic() - t0 >= 1.5
    finally:
        holder.kill()
        holder.wait(timeout=10)


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("refusals") / "run"
    assert app.main(RUN + ["trainer.max_steps=2", f"trainer.run_dir={run}"]) == 0
    return run


@pytest.mark.parametrize("overrides, words", [
    (["trainer.resume=never"], "trainer.resume=never"),
    (["model.n_layer=2"], "different model shape"),
    (["data.tokenizer=gpt2"], "trained with data.tokenizer=char"),
    # resume=never once built a fresh gpt2 tokenizer and wrote it over the char one
    (["trainer.resume=never", "data.tokenizer=gpt2"], "trainer.resume=never"),
])
def test_refused_launch_changes_no_file(trained, overrides, words, capsys):
    before = listing(trained)
    capsys.readouterr()
    assert app.main(RUN + ["trainer.max_steps=4", f"trainer.run_dir={trained}", *overrides]) == 2
    assert words in one_error_line(capsys.readouterr().err)
    assert listing(trained) == before
    # and the original config still resumes (at its last step: nothing left to train)
    assert app.main(RUN + ["trainer.max_steps=2", f"trainer.run_dir={trained}"]) == 0
    assert f"nothing left to train: {trained} is at step 2" in capsys.readouterr().out


def test_refused_launch_into_a_new_folder_leaves_no_folder(tmp_path, capsys):
    run = tmp_path / "new" / "run"
    assert app.main(RUN + [f"trainer.run_dir={run}", f"data.path={tmp_path}/missing.txt"]) == 2
    assert "does not exist" in one_error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def launch_as_other_user(args: list[str]) -> tuple[int, str]:
    """app.main(args) in a forked child that cannot write what this user made: as root (which
    ignores file modes) the child drops to uid/gid 65534 ("nobody"). Returns (exit code, stderr)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            os.close(read)
            sys.stderr = io.TextIOWrapper(os.fdopen(write, "wb"), write_through=True)
            sys.stdout = open(os.devnull, "w")
            if os.geteuid() == 0:
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
            # on the CPU in a cuda session too: a forked child cannot start CUDA that its parent
            # (this pytest process) may have started; the run folder's check is the same on any device
            code = app.main(args + ["trainer.device=cpu"])
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "r") as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err


@pytest.mark.launch
def test_read_only_run_dir_is_bad_input(trained):
    base = Path(tempfile.mkdtemp(prefix="mingpt-read-only-"))  # pytest's tmp_path is root-only
    try:
        run = base / "run"
        shutil.copytree(trained, run)
        for p in [base, *run.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        run.chmod(0o555)
        (run / "launch.lock").chmod(0o666)  # the lock file opens; the folder itself is read-only
        before = listing(run)
        args = RUN + ["trainer.max_steps=4", f"data.cache_dir={base}"]  # ~/.cache: root's own
        # the existing run, resumed by a user who cannot write it
        rc, err = launch_as_other_user(args + [f"trainer.run_dir={run}"])
        assert rc == 2 and f"(Permission denied: {run});" in one_error_line(err), err
        assert listing(run) == before
        # a new run folder inside it
        rc, err = launch_as_other_user(args + [f"trainer.run_dir={run}/new"])
        assert rc == 2 and f"(Permission denied: {run}/new);" in one_error_line(err), err
        assert listing(run) == before
    finally:
        for p in [base, *base.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(base)


@pytest.mark.launch
def test_unreadable_cache_dir_is_one_line_and_ignored_for_a_local_corpus():
    """Another user's ~/.cache (as "nobody", root's home is mode 700): Path.exists() itself raises
    PermissionError. A URL corpus needs the cache: one line, exit 2; a local corpus never reads it."""
    base = Path(tempfile.mkdtemp(prefix="mingpt-cache-"))  # pytest's tmp_path is root-only
    try:
        base.chmod(0o777)
        unreadable = "/root/.cache/mingpt-parallel-test"
        rc, err = launch_as_other_user(RUN + ["trainer.max_steps=2", f"trainer.run_dir={base}/url",
                                              "data.path=http://127.0.0.1:9/corpus.txt",
                                              f"data.cache_dir={unreadable}"])
        assert rc == 2 and "data.cache_dir='/root/.cache/mingpt-parallel-test' cannot be read" \
            in one_error_line(err), err
        assert not (base / "url").exists()
        rc, err = launch_as_other_user(RUN + ["trainer.max_steps=2", f"trainer.run_dir={base}/local",
                                              f"data.cache_dir={unreadable}"])
        assert rc == 0, err
        assert (base / "local" / "snapshots" / "step_0000002").is_dir()
    finally:
        shutil.rmtree(base)


def test_a_lock_file_removed_while_waiting_is_not_trusted(tmp_path, monkeypatch):
    """A refused launch that created the folder removes it again (lock file included). A launch that
    opened the file just before and locks it afterwards would hold a lock on a deleted file; the
    interleaving is forced here: the first launch's removal runs between the second's open and flock."""
    run_dir = tmp_path / "new" / "run"
    first = runlock.RunLock(run_dir)
    first.acquire()  # created the folders; about to be refused and to remove them
    real_flock = fcntl.flock
    calls = []

    def flock_after_the_removal(fd, op):
        if not calls:
            first.release()  # the removal: file and folders are gone, fd still open in `second`
        calls.append(op)
        return real_flock(fd, op)

    monkeypatch.setattr(runlock.fcntl, "flock", flock_after_the_removal)
    second = runlock.RunLock(run_dir)
    second.acquire()
    assert len(calls) == 2  # the first lock was on a deleted file: it started over
    assert os.fstat(second._fd).st_ino == os.stat(run_dir / runlock.LOCK_FILE).st_ino
    second.release()
