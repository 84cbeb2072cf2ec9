"""The full 3-D mesh in CI: dp=2 x tp=2 x pp=2 on 8 processes matches one process
(first-step gradients, loss at each of 6 steps, val loss), HSDP x tp does too, and main.py
trains, evaluates and writes model.pt on that mesh. Runs benchmarks/mesh_2x2x2.py (the session's
one 8-process launch, conftest.eight_processes), which prints the figures."""
import pytest

from testing.local import python

pytestmark = pytest.mark.launch


def test_dp2_tp2_pp2_matches_one_process_and_the_app_runs(eight_processes):
    r, _ = eight_processes
    assert "parity: OK" in r.stdout and "main.py on the mesh: exit 0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_keep_refuses_a_folder_with_files_in_one_line(tmp_path):
    """A second run into the same --keep folder would resume its finished run folders instead of
    training: refused before anything starts, the folder left as it was."""
    (tmp_path / "app").mkdir()
    r = python(["benchmarks/mesh_2x2x2.py", "--app", "--keep", str(tmp_path)], timeout=120)
    assert r.returncode == 2 and r.stderr == f"error: --keep {tmp_path} is not empty: name a new or empty folder\n", r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["app"]
