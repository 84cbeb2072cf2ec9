"""A rank that stops without dying is named within trainer.hang_timeout_s, the group exits 4, and
torchrun's restart resumes from the newest snapshot, bit-identical to an uninterrupted run.

Each hang is real: a SIGSTOP to one of two workers (alive to torchrun, frozen: it never reports),
and a worker whose training thread blocks on a lock outside any collective (it reports, and its
flight record shows it never entered the collective its peer waits in). Without the watchdog both
wait for the process-group timeout (60 s in these tests, 600 s by default) and name no one.
"""
from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path

import pytest
import torch

from conftest import DDP_REFERENCE
from guards.watchdog import HANG_EXIT, RankReport, compact_ranks, hang_line
from harness import StreamedLaunch
from testing.local import rank_pid, torchrun, torchrun_argv

COMMON = DDP_REFERENCE + ["trainer.hang_timeout_s=3"]  # a hang named within seconds (changes no number)
RESTART = ["--max-restarts=1", "--monitor-interval=0.2"]
HOST = socket.gethostname()


def hang_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("hang: ")]


def model(path: Path) -> dict:
    return torch.load(path, weights_only=True)["model"]


def run_and_kill_the_frozen_rank(args: list[str], frozen_rank: int, **env) -> tuple[int, str]:
    """torchrun ARGS under --max-restarts=1; once the `hang:` line is printed, SIGKILL the frozen
    rank, as torchrun itself does 30 s after its SIGTERM (pending while a process is stopped).
    torch 2.13's restart ignores --shutdown-timeout for that wait (_stop_workers calls _shutdown()
    with its 30 s default; https://github.com/pytorch/pytorch/pull/192815): the kill only saves the
    test those 30 s. Returns (exit code, stdout + stderr)."""
    with StreamedLaunch(torchrun_argv(2, args, RESTART), **env) as job:
        named = job.wait_for(lambda: bool(hang_lines(job.output())))
        assert named, "no hang line within 120 s:\n" + job.output()[-4000:]
        if job.proc.poll() is None:
            os.kill(rank_pid(job.proc.pid, frozen_rank), signal.SIGKILL)
        rc = job.proc.wait(timeout=120)
    return rc, job.output()


def test_the_line_names_who_did_not_arrive_and_where_the_others_wait(tmp_path):
    """At 1,024 ranks: one rank silent, one behind on the default group, the rest in one collective."""
    def report(rank, seq, where="trainer.py:250 in train", waits="all_reduce #84 on default_pg"):
        return RankReport(rank, "h0", rank % 8, 20, "train", 31.4, where, waits, {"default_pg": seq, "group 1": 20})
    reports = {r: report(r, 84) for r in range(1024) if r not in (5, 700)}
    reports[700] = report(700, 83, where="snapshots/writer.py:40 in write", waits="")
    line = hang_line(reports, 1024, {5: ("h0", 5)}, tmp_path)
    assert line.startswith(
        "hang: rank 5 (host h0, local rank 5) has not finished step 21 for 31 s and does not answer (stopped, "
        "frozen or dead); rank 700 (host h0, local rank 4) has not finished step 21 for 31 s and never entered "
        "the collective the others wait in: it is at snapshots/writer.py:40 in write; ranks 0-4, 6-699, 701-1023 "
        "wait in all_reduce #84 on default_pg (trainer.py:250 in train)"), line
    assert compact_ranks([3]) == "rank 3" and compact_ranks([0, 1, 2, 5]) == "ranks 0-2, 5"


@pytest.mark.launch
def test_sigstop_names_the_frozen_rank_and_the_restart_ends_bit_identical(ddp_reference, tmp_path):
    """`stop:update:12:1`: rank 1 freezes after step 12. Rank 0's watchdog names it within ~3 s
    (+ 5 s for the reports it never sends), points at the collective rank 0 waits in, and exits 4;
    the frozen rank is SIGKILLed and torchrun restarts the group, which resumes from step 10."""
    run = tmp_path / "run"
    rc, out = run_and_kill_the_frozen_rank(["main.py", *COMMON, f"trainer.run_dir={run}"], 1,
                                           MINGPT_FAULT="stop:update:12:1")
    assert rc == 0, out[-4000:]
    lines = hang_lines(out)
    assert len(lines) == 1, out[-4000:]
    dumps = run / "hang" / "attempt0"
    assert re.fullmatch(
        rf"hang: rank 1 \(host {re.escape(HOST)}, local rank 1\) has not finished step 13 for \d+ s and does not "
        r"answer \(stopped, frozen or dead\); rank 0 waits in \w+ #\d+ on \S+ \((trainer|parallel/\w+)\.py:\d+ in \w+\); "
        rf"dumps in {re.escape(str(dumps))}; exit code {HANG_EXIT}: torchrun --max-restarts restarts from the "
        r"newest snapshot", lines[0]), lines[0]
    # never before the configured timeout (a lower bound on a clock: no slow machine breaks it; how
    # soon after it the line comes is a matter for a benchmark, not a test)
    assert int(re.search(r"for (\d+) s", lines[0]).group(1)) >= 3, lines[0]
    assert (dumps / "fr_trace_rank_0").stat().st_size > 0 and "(training)" in (dumps / "stacks_rank_0.txt").read_text()
    assert not (dumps / "fr_trace_rank_1").exists()  # a stopped rank dumps nothing
    assert f"resumed from {run / 'snapshots' / 'step_0000010'} at step 10" in out, out[-4000:]
    # the reference saves in the background, this run synchronously: also the proof that background
    # saves train the same model (tests/test_async_save.py)
    a, b = model(ddp_reference / "model.pt"), model(run / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.launch
def test_a_rank_blocked_outside_any_collective_is_named_with_where_it_is(tmp_path):
    """`block:update:7:1`: rank 1's training thread deadlocks on a lock after step 7, outside any
    collective. Both watchdogs report; rank 1's flight record is one collective behind rank 0's, so
    the line names rank 1 with the line it is stuck at, and rank 0's collective. Without restarts
    torchrun fails the job, and its summary holds the same line."""
    run = tmp_path / "run"
    r = torchrun(2, ["main.py", *COMMON, f"trainer.run_dir={run}"], timeout=120, MINGPT_FAULT="block:update:7:1")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    lines = hang_lines(r.stdout)
    assert len(lines) == 1, out[-4000:]
    assert re.match(
        rf"hang: rank 1 \(host {re.escape(HOST)}, local rank 1\) has not finished step 8 for \d+ s and never entered "
        r"the collective the others wait in: it is at testing/faults.py:\d+ in block_forever; rank 0 waits in "
        r"\w+ #\d+ on \S+ \(", lines[0]), lines[0]
    assert f"exitcode  : {HANG_EXIT}" in r.stderr and lines[0] in r.stderr, r.stderr[-3000:]  # torchrun's summary
    assert {p.name for p in (run / "hang" / "attempt0").iterdir()} == {
        "fr_trace_rank_0", "fr_trace_rank_1", "stacks_rank_0.txt", "stacks_rank_1.txt"}
