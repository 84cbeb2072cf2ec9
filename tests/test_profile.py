"""trainer.profile=START:STEPS writes a trace per rank that Perfetto opens: the chosen steps as
`step N` ranges, with the step's collectives in them."""
from __future__ import annotations

import json

import pytest

from observe.profiling import trace_names
from testing.local import TINY, python, torchrun

pytestmark = pytest.mark.launch


def test_a_ddp_run_writes_a_trace_of_the_chosen_steps_per_rank(tmp_path):
    run = tmp_path / "run"
    r = torchrun(2, ["main.py", *TINY, "parallel.strategy=ddp", "trainer.max_steps=6", "trainer.profile=3:2",
                     f"trainer.run_dir={run}"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"profile: steps 3-4 written to {run / 'profile'}/rank<R>.json" in r.stderr
    for rank in (0, 1):
        path = run / "profile" / f"rank{rank}.json"
        events = json.loads(path.read_text())["traceEvents"]  # chrome://tracing's format
        names = trace_names(path)
        assert {"step 3", "step 4"} <= names and "step 2" not in names and "step 5" not in names
        assert any("allreduce" in n for n in names), sorted(names)[:50]  # DDP's gradient all-reduce
        assert any(e.get("name") == "aten::mm" or e.get("name") == "aten::addmm" for e in events)


def test_a_window_past_the_end_is_cut_and_noted_and_kineto_prints_nothing(tmp_path):
    """A window that runs past the last step is profiled up to it (the trace was never written
    before), one past the end profiles nothing, and each says so in a note: never silence.
    Kineto's own `USDT: ... profiler_start` lines are not printed."""
    run = tmp_path / "run"
    r = python(["main.py", *TINY, "parallel.strategy=none", "trainer.max_steps=4", "trainer.profile=2:5",
                f"trainer.run_dir={run}"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "note: trainer.profile=2:5 asks for steps 2-6 but the run ends at step 4: steps 2-3 are profiled" \
        in r.stdout, r.stdout
    assert {"step 2", "step 3"} <= trace_names(run / "profile" / "rank0.json")
    assert "USDT" not in r.stderr and "profiler_start" not in r.stderr, r.stderr
    r = python(["main.py", *TINY, "parallel.strategy=none", "trainer.max_steps=4", "trainer.profile=30:3",
                f"trainer.run_dir={tmp_path / 'past'}"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "note: trainer.profile=30:3 asks for steps 30-32 but the run ends at step 4: nothing is profiled; " \
        "choose START from 0 to 3" in r.stdout, r.stdout
    assert not (tmp_path / "past" / "profile").exists()
