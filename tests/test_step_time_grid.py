"""benchmarks/step_time_grid.py prices each shape by the calibration made just before it was
measured, and a replan on another machine by that machine's own figures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.local_hardware import UNCALIBRATED, cache_key
from testing.local import REPO


@pytest.fixture
def grid(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a rank's threads: the figures' key names them
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setenv("MINGPT_PEAK_CACHE", str(tmp_path / "machine" / "peak-flops.json"))
    import step_time_grid
    return step_time_grid


def figures(efficiency: float) -> dict:
    return {**UNCALIBRATED, "compute_efficiency": efficiency}


def test_a_replan_uses_the_shape_s_own_calibration_on_this_machine(grid, tmp_path, monkeypatch):
    """Each shape's figures come from its calibration-<shape>/ folder, never measured again by a
    replan, and the environment is left as it was."""
    folder = tmp_path / "out" / "calibration-B"
    folder.mkdir(parents=True)
    (folder / "local-hardware.json").write_text(json.dumps({cache_key(): figures(0.61)}))
    (folder / "peak-flops.json").write_text("{}")
    monkeypatch.setattr(grid, "measure_local", lambda: pytest.fail("a replan measured"))
    monkeypatch.setattr("planner.local_hardware.cpu_peak", lambda dtype: (1e11, "test"))
    hw = grid.shape_hardware(tmp_path / "out", "B", calibrate=False)
    assert hw.compute_efficiency == 0.61 and "calibration-B" in hw.source
    assert grid.os.environ["MINGPT_PEAK_CACHE"] == str(tmp_path / "machine" / "peak-flops.json")


def test_another_machine_s_calibration_falls_back_to_this_machine_s_figures(grid, tmp_path, monkeypatch):
    """A folder calibrated on another CPU (another fingerprint) is not this machine's: the replan
    predicts with this machine's own cache, and writes nothing into the folder."""
    folder = tmp_path / "out" / "calibration-B"
    folder.mkdir(parents=True)
    theirs = json.dumps({"another CPU | local hardware": figures(0.61)})
    (folder / "local-hardware.json").write_text(theirs)
    mine = tmp_path / "machine"
    mine.mkdir()
    (mine / "local-hardware.json").write_text(json.dumps({cache_key(): figures(0.77)}))
    monkeypatch.setattr(grid, "measure_local", lambda: pytest.fail("a replan measured"))
    monkeypatch.setattr("planner.local_hardware.cpu_peak", lambda dtype: (1e11, "test"))
    hw = grid.shape_hardware(tmp_path / "out", "B", calibrate=False)
    assert hw.compute_efficiency == 0.77
    assert (folder / "local-hardware.json").read_text() == theirs


def row(shape: str, layout: str, ratio: float, fit: bool = True) -> dict:
    return {"shape": shape, "layout": layout, "fit": fit, "ratio": ratio, "measured_ms": 10 * ratio, "predicted_ms": 10.0}


def test_each_row_takes_the_median_of_its_grids(grid):
    """A row slow in one grid of three (a slow minute) is inside at its median; one outside in two
    of three is outside; a row some grid did not measure is left out rather than judged on fewer."""
    grids = [[row("A", "ddp dp2", 1.45), row("A", "tp2", 0.70), row("B", "ddp dp2", 1.0, fit=False)],
             [row("A", "ddp dp2", 1.05), row("A", "tp2", 0.75), row("B", "ddp dp2", 1.1, fit=False)],
             [row("A", "ddp dp2", 1.10), row("A", "tp2", 0.95)]]
    rows = {(r["shape"], r["layout"]): r for r in grid.median_rows(grids)}
    assert set(rows) == {("A", "ddp dp2"), ("A", "tp2")}
    assert rows["A", "ddp dp2"]["ratio"] == 1.10 and rows["A", "ddp dp2"]["ratios"] == [1.45, 1.05, 1.10]
    assert rows["A", "ddp dp2"]["measured_ms"] == pytest.approx(11.0) and rows["A", "tp2"]["ratio"] == 0.75
    shape_a = next(s for s in grid.SHAPES if s.name == "A")
    table = grid.median_table(list(rows.values()), [shape_a])
    assert table[2] == "| ddp dp2 | 1.10 (1.05-1.45) |" and table[3] == "| tp2 | 0.75 * (0.70-0.95) |"
    assert grid.summary(list(rows.values()))[0] == "fit: 2 rows, 1 outside 20%, median ratio 0.93, range 0.75-1.10"


def test_median_of_grids_prices_each_by_its_own_calibration(grid, tmp_path, monkeypatch, capsys):
    """--median-of replans each folder with its own calibration-<shape>/ figures (a faster
    calibration in one folder lowers only that folder's predictions) and writes OUT/grid.md; a
    folder holding no measurement is refused in one line, exit 2, before anything is written."""
    monkeypatch.setattr(grid, "measure_local", lambda: pytest.fail("a replan measured"))
    monkeypatch.setattr("planner.local_hardware.cpu_peak", lambda dtype: (1e11, "test"))
    measured = json.loads((REPO / "docs" / "grid-n2" / "measured-A.json").read_text())
    folders = []
    for i, efficiency in enumerate((0.5, 0.5, 0.9)):
        folder = tmp_path / f"g{i}"
        (folder / "calibration-A").mkdir(parents=True)
        (folder / "calibration-A" / "local-hardware.json").write_text(json.dumps({cache_key(): figures(efficiency)}))
        (folder / "calibration-A" / "peak-flops.json").write_text("{}")
        (folder / "measured-A.json").write_text(json.dumps(measured))
        folders.append(str(folder))
    out = tmp_path / "median"
    monkeypatch.setattr(grid.sys, "argv", ["step_time_grid.py", "--out", str(out), "--shapes", "A", "--median-of", *folders])
    grid.main()
    got = json.loads((out / "grid.json").read_text())
    ddp = next(r for r in got["rows"] if r["layout"] == "ddp dp2")
    low, _, high = sorted(ddp["ratios"])
    assert ddp["ratios"][0] == ddp["ratios"][1] == ddp["ratio"] == low and ddp["ratios"][2] == high > low
    assert "over 3 grids" in (out / "grid.md").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(grid.sys, "argv", ["step_time_grid.py", "--out", str(tmp_path / "x"), "--median-of", str(empty), folders[0]])
    with pytest.raises(SystemExit) as e:
        grid.main()
    assert e.value.code == 2 and "no measured-<shape>.json in" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert "calibration-A" in (out / "grid.md").read_text()  # each grid's figures named, its own folder
    for argv, says in ((["--median-of", folders[0], folders[0]], "at least two different grid folders"),
                       (["--shapes", "B", "--median-of", *folders], None)):
        monkeypatch.setattr(grid.sys, "argv", ["step_time_grid.py", "--out", str(tmp_path / "y"), *argv])
        with pytest.raises(SystemExit) as e:
            grid.main()
        if says:
            assert e.value.code == 2 and says in capsys.readouterr().err
        else:  # no grid measured B: one line, no table
            assert "no shape of B was measured in every grid" in str(e.value.code)
    before = (out / "grid.md").read_text()
    monkeypatch.setattr(grid.sys, "argv", ["step_time_grid.py", "--out", folders[0], "--median-of", *folders])
    with pytest.raises(SystemExit) as e:
        grid.main()
    assert e.value.code == 2 and "is one of the --median-of grids" in capsys.readouterr().err
    assert not (Path(folders[0]) / "grid.md").exists() and (out / "grid.md").read_text() == before
