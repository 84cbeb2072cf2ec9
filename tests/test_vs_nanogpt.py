"""benchmarks/vs_nanogpt.py --turns: the trainings of a seed take turns on the machine (SIGSTOP /
SIGCONT of each process group) and every one runs to its end; interrupted (Ctrl-C), none is left
behind, stopped or running. Stand-in commands (short Python processes), not trainings."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from testing.local import REPO, child_env

pytestmark = pytest.mark.launch

BENCHMARKS = REPO / "benchmarks"


def test_turns_run_every_command_to_its_end(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from vs_nanogpt import run_processes
    said = "import sys, time; [time.sleep(0.05) for _ in range(10)]; print(sys.argv[1])"
    commands = [([sys.executable, "-c", said, str(i)], REPO) for i in range(3)]
    done = run_processes(commands, threads=1, turns=0.1)
    assert [(d.returncode, d.stdout.strip()) for d in done] == [(0, "0"), (0, "1"), (0, "2")]
    assert all(d.wall_s > 0 for d in done)


def test_a_step_a_process_was_stopped_in_is_left_out(monkeypatch):
    """Each stand-in prints a row every 20 ms with the seconds since its previous row, read before it
    prints, as nanoGPT does (so lead 2, see vs_nanogpt.kept). Counted after each turn, the rows kept
    took 20 ms each: none spans a stop, which lasts the other's whole turn (0.3 s); what was left out
    is at most two rows per turn."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from vs_nanogpt import kept, run_processes
    rows = ("import time\nlast = time.perf_counter()\nfor _ in range(80):\n    time.sleep(0.02)\n"
            "    now = time.perf_counter()\n    print(f'row {now - last:.4f}', flush=True)\n    last = now\n")
    count = lambda out: out.read_text().count("\n")  # noqa: E731
    done = run_processes([([sys.executable, "-c", rows], REPO)] * 2, threads=1, turns=0.3, rows=[count, count])
    for d in done:
        seconds = [float(line.split()[1]) for line in d.stdout.splitlines()]
        values, _ = kept(d, seconds, skip=0, lead=2)
        assert len(seconds) == 80 and len(values) >= 80 - 2 * len(d.turns)
        assert max(values) < 0.2, "a kept row spans a stop"
        assert max(seconds) > 0.25, "no row was stopped: the test proves nothing"
        assert [c for c, _ in d.turns] == list(range(len(d.turns))) and len(d.turns) >= 4
        assert [i for _, r in d.turns for i in r] == list(range(80))  # every row in exactly one turn


def test_an_interrupted_run_leaves_no_process_behind(tmp_path):
    pid_files = [tmp_path / f"child{i}.pid" for i in range(2)]
    child = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
    runner = (
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal: Ctrl-C raises\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "from vs_nanogpt import run_processes\n"
        f"run_processes([([sys.executable, '-c', {child!r}, p], '.') for p in {[str(p) for p in pid_files]!r}], 1, 0.2)\n")
    proc = subprocess.Popen([sys.executable, "-c", runner], cwd=REPO, env=child_env(), stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not all(p.is_file() and p.read_text() for p in pid_files):  # both started (and taking turns)
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    for p in pid_files:
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left stopped
            os.kill(int(p.read_text()), 0)
