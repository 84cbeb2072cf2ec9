"""benchmarks/vs_nanogpt.py's bookkeeping under --turns, on made-up rows: the counters agree with the
parsers row for row, the rows of each turn that span a stop are left out, an iteration of nanoGPT's
that evaluates is not a step, the cycle ratio is ours over nanoGPT's tokens/s, and a --turns too
short to keep a window is refused in one line."""
from __future__ import annotations

import json
import sys

import pytest

from testing.local import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import vs_nanogpt  # noqa: E402
from vs_nanogpt import Finished, cycle_ratios, kept, nanogpt_result, nanogpt_rows, our_rows  # noqa: E402


def nanogpt_lines(times: list[float]) -> str:
    lines = ["number of parameters: 0.80M", "step 0: train loss 4.2, val loss 4.2"]
    for i, t in enumerate(times):
        lines.append(f"iter {i}: loss 4.1000, time {t:.2f}ms, mfu -100.00%")
    return "\n".join(lines) + "\n"


def test_the_counters_count_what_the_parsers_read(tmp_path):
    out = tmp_path / "0.out"
    out.write_text(nanogpt_lines([50.0, 40.0, 41.0]) + "iter 3: loss 4.0")  # a line cut by a stop is not one
    assert nanogpt_rows(out) == 3
    assert our_rows(tmp_path / "run") == 0  # no metrics.jsonl yet
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (10, 20)))
    assert our_rows(tmp_path / "run") == 2


def test_kept_leaves_out_the_rows_that_span_a_stop():
    values = [9.0, 1.0, 2.0, None, 4.0, 5.0, 6.0, 7.0]
    r = Finished("", "", 0, 1.0, turns=[(0, range(0, 3)), (1, range(3, 3)), (2, range(3, 8))])
    assert kept(r, values, skip=0, lead=1) == ([1.0, 2.0, 4.0, 5.0, 6.0, 7.0], {0: [1.0, 2.0], 2: [4.0, 5.0, 6.0, 7.0]})
    assert kept(r, values, skip=0, lead=2) == ([2.0, 5.0, 6.0, 7.0], {0: [2.0], 2: [5.0, 6.0, 7.0]})
    assert kept(r, values, skip=5, lead=1) == ([5.0, 6.0, 7.0], {2: [5.0, 6.0, 7.0]})  # skip counts rows of the run
    assert kept(Finished("", "", 0, 1.0), values, skip=1, lead=1) == ([1.0, 2.0, 4.0, 5.0, 6.0, 7.0], {})


def test_nanogpts_evaluating_iterations_are_not_steps(tmp_path):
    times = [900.0] + [40.0] * 9 + [700.0] + [42.0] * 9  # iter 0 and 10 evaluate (eval_interval 10)
    r = Finished(nanogpt_lines(times), "", 0, 1.0)
    got = nanogpt_result(r, tmp_path, 1337, eval_interval=10)
    assert got["step_ms"] == 42.0 and max(got["windows_ms"]) < 50  # iters 5-19 without 10: 40 x 4, 42 x 9
    # lead 2 and skip 5: turn 0 keeps iters 5-9 and 11, turn 1 iters 14-19
    turns = Finished(nanogpt_lines(times), "", 0, 1.0, turns=[(0, range(0, 12)), (1, range(12, 20))])
    assert nanogpt_result(turns, tmp_path, 1337, eval_interval=10)["cycles"] == {0: [40.0] * 5 + [42.0], 1: [42.0] * 6}


def test_the_cycle_ratio_is_ours_over_nanogpts_tokens_per_second():
    nano = {"cycles": {0: [40.0, 44.0], 2: [50.0]}, "tokens_per_step": 768}
    ours = {"cycles": {0: [21.0], 1: [30.0], 2: [25.0]}, "tokens_per_step": 768}
    assert cycle_ratios(nano, ours) == [2.0, 2.0]  # cycle 1 has no nanoGPT steps: not compared
    assert cycle_ratios(nano, {**ours, "tokens_per_step": 1536}) == [4.0, 4.0]
    with pytest.raises(SystemExit, match="longer --turns"):
        cycle_ratios(nano, {"cycles": {1: [30.0]}, "tokens_per_step": 768})


def test_a_turn_too_short_for_a_window_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["vs_nanogpt.py", "--turns", "0.5"])
    with pytest.raises(SystemExit) as e:
        vs_nanogpt.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--turns" in err
