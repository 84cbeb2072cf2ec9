"""Snapshots in the background (trainer.async_save=true): the run trains the same model as with
synchronous saves, a SIGKILL in the middle of a background write never leaves a snapshot a resume
would take, and a SIGTERM while a save is in flight lets it finish, then saves the stop step.
Each fault is real: the kill and the signal come from the rank's own background write
(`MINGPT_FAULT=kill:write:STEP:RANK`, `term:write:...`: as it starts writing its files, while the
step loop goes on).

Launches: the session's ddp_reference (tests/conftest.py), which saves in the background: its
snapshots and save timings are checked here, and the synchronous-save runs that end bit-identical
to it (tests/test_hang.py, tests/test_storage_faults.py) prove the same model; then the kill and
the SIGTERM, one launch each."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import DDP_REFERENCE_ASYNC as ASYNC
from snapshots.store import list_snapshots, validate_snapshot
from testing.local import torchrun

pytestmark = pytest.mark.launch

RESTART = ["--max-restarts=1", "--monitor-interval=0.2"]


def model(run) -> dict:
    return torch.load(run / "model.pt", weights_only=True)["model"]


def assert_same_model(a, b) -> None:
    ta, tb = model(a), model(b)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def valid_steps(run) -> list[int]:
    return sorted(int(p.name[5:]) for p in list_snapshots(run / "snapshots") if validate_snapshot(p)[0] is not None)


def test_the_reference_saves_in_the_background_and_logs_their_timings(ddp_reference):
    """The session's reference run saves in the background (exit 0 and no false hang alarm: the
    fixture). That it trains the same model as synchronous saves, bit for bit, is proven by every
    synchronous-save run compared with it: test_hang.py's SIGSTOP restart (always run) and
    test_storage_faults.py's full disk and I/O error."""
    run = ddp_reference
    assert valid_steps(run) == [15, 20]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # each save's timings on the first log row after it was waited for (by the next save: the
    # saves of steps 15 and 20 are waited for at 20 and at the end, after the last row)
    timed = [row for row in rows if "save_total_ms" in row]
    assert [row["save_step"] for row in timed] == [5, 10], rows
    assert all(0 < row["save_blocking_ms"] <= row["save_total_ms"] for row in timed)


def test_a_kill_during_a_background_write_leaves_no_snapshot_and_the_restart_matches(ddp_reference, tmp_path):
    """Rank 1 is SIGKILLed as it starts writing snapshot 10 in the background: the temporary folder
    is never committed, torchrun restarts the group, which resumes from step 5 and ends bit-identical."""
    run = tmp_path / "run"
    r = torchrun(2, ["main.py", *ASYNC, f"trainer.run_dir={run}"], timeout=300, extra_torchrun=RESTART,
                 MINGPT_FAULT="kill:write:10:1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'snapshots' / 'step_0000005'} at step 5" in r.stdout, r.stdout[-3000:]
    assert_same_model(ddp_reference, run)


def test_sigterm_while_a_save_is_in_flight_finishes_it_then_saves_the_stop_step(tmp_path):
    run = tmp_path / "run"
    r = torchrun(2, ["main.py", *ASYNC, f"trainer.run_dir={run}"], timeout=240, MINGPT_FAULT="term:write:10:0")
    assert r.returncode == 0, r.stderr[-3000:]
    stop = [line for line in r.stdout.splitlines() if line.startswith("stopped by SIGTERM at step ")]
    assert len(stop) == 1, r.stdout[-3000:]
    stopped_at = int(stop[0].split()[5].rstrip(":"))
    assert stopped_at > 10 and valid_steps(run) == [10, stopped_at], (stop, valid_steps(run))
