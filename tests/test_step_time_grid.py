"""benchmarks/step_time_grid.py prices each shape by the calibration made just before it was
measured, and a replan on another machine by that machine's own figures."""
from __future__ import annotations

import json

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
