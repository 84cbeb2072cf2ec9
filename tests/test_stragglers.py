"""A straggler is named: a rank whose core is shared with a busy process computes slower, and
metrics.jsonl and one warning line say which rank, though every rank's step time is the same.

The slowdown is real and comes from outside the project: the test pins rank 0 and rank 1 to a
core each and starts busy processes on rank 1's core, as noisy neighbours on a host would (each in a
session of its own, as another job's: see BUSY).
The decision itself (margin, windows, one warning) is checked on given figures, without a clock.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings

import pytest

from guards.stragglers import SLOW_MARGIN, SLOW_WINDOWS, StragglerWatch, median_without, thread_clock_ns
from testing.local import REPO, TINY, child_env, multiprocess_lock, torchrun_argv, worker_pids, worker_rank

BUSY = 4  # busy processes on rank 1's core, each in a session of its own
# Why sessions of their own: with the kernel's autogroup scheduling (sched_autogroup_enabled, on by
# default) a session's processes share one scheduling weight, and torchrun starts each worker in a
# new session. Busy processes left in pytest's session shared one weight against rank 1's, so rank 1
# got half of its core whenever it woke and came out barely slower than rank 0 (22 vs 20 ms per
# step on a loaded machine). In sessions of their own, as other jobs on a host are, each weighs as
# much as rank 1, which gets a fifth of its core.
CONFIG = TINY + ["parallel.strategy=ddp", "model.n_embd=64", "model.block_size=32", "trainer.max_steps=60",
                 "trainer.log_every=5", "trainer.eval_every=0", "trainer.sample_tokens=0"]


def pin_workers(agent_pid: int) -> None:
    """Pin rank r to core r as soon as torchrun has started both workers (the worker's main thread:
    its training thread)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = {worker_rank(p): p for p in worker_pids(agent_pid)}
        if {0, 1} <= ranks.keys():
            for rank in (0, 1):
                os.sched_setaffinity(ranks[rank], {rank})
            return
        time.sleep(0.05)
    raise AssertionError("torchrun did not start its two workers within 60 s")


def test_the_median_of_the_other_ranks():
    assert median_without([1.0, 2.0], 1) == 1.0 and median_without([1.0, 2.0, 10.0], 2) == 1.5
    assert median_without([1.0, 2.0, 3.0, 10.0], 0) == 3.0 and median_without([5.0], 0) == 5.0


def test_a_rank_slower_than_the_others_by_the_margin_for_the_windows_is_named_once():
    """The decision on given figures (no clock): 3 windows in a row above 1 + SLOW_MARGIN times the
    other ranks' median name the rank once; a window at the margin resets the count."""
    watch = StragglerWatch(0, 3, 0, True, True)
    watch._who = [("h", 0), ("h", 1), ("h", 2)]
    over, at = 10 * (1 + SLOW_MARGIN) + 0.1, 10 * (1 + SLOW_MARGIN)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, slow in enumerate([over, over, at, over, over], 1):  # never 3 in a row
            watch._note_slow(step, [10.0, slow, 10.0])
        assert not caught
        for step in (6, 7, 8):  # the 3rd of a row at step 6; named once
            watch._note_slow(step, [10.0, over, 10.0])
    assert [str(w.message)[:53] for w in caught] == ["straggler: rank 1 (host h, local rank 1) computes 21%"]
    assert f"for {SLOW_WINDOWS} log windows up to step 6;" in str(caught[0].message)


def test_the_thread_clock_counts_work_and_waiting_for_a_core_not_sleep():
    """Two clocks over the same intervals, no threshold of the machine's speed: a thread that never
    sleeps is on a core or waiting for one all the time (its clock keeps up with the wall clock,
    however loaded the machine); a sleep of 0.5 s costs one wake-up, far less than 0.2 s of work."""
    start = thread_clock_ns()
    time.sleep(0.5)
    slept = thread_clock_ns() - start
    start, t0 = thread_clock_ns(), time.perf_counter_ns()
    while time.perf_counter_ns() - t0 < 0.2e9:
        pass
    worked, wall = thread_clock_ns() - start, time.perf_counter_ns() - t0
    assert worked >= 0.9 * wall and slept < worked / 4, (slept, worked, wall)


@pytest.mark.launch
def test_a_rank_sharing_its_core_with_a_busy_process_is_named(tmp_path):
    run = tmp_path / "run"
    with multiprocess_lock():
        agent = subprocess.Popen(torchrun_argv(2, ["main.py", *CONFIG, f"trainer.run_dir={run}"]), cwd=REPO,
                                 env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                for _ in range(BUSY)]
        try:
            for b in busy:
                os.sched_setaffinity(b.pid, {1})
            pin_workers(agent.pid)
            out, err = agent.communicate(timeout=240)
        finally:
            for b in busy:
                b.kill()
            agent.kill()
    assert agent.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["compute_ms_min"] <= r["compute_ms_median"] <= r["compute_ms_max"] for r in rows)
    later = rows[2:]  # the first windows include start-up work
    assert sum(r["compute_slowest_rank"] == 1 for r in later) >= len(later) - 1, rows
    warned = [line for line in err.splitlines() if "straggler:" in line]
    assert len(warned) == 1, err[-3000:]
    assert f"straggler: rank 1 (host {socket.gethostname()}, local rank 1) computes " in warned[0], warned
    assert "slower than the median of the other ranks" in warned[0] and f"for {SLOW_WINDOWS} log windows" in warned[0]
