"""The full 3-D mesh in CI: dp=2 x tp=2 x pp=2 on 8 processes matches one process
(first-step gradients, loss at each of 6 steps, val loss), and main.py trains, evaluates and
writes model.pt on that mesh. Runs benchmarks/mesh_2x2x2.py, which prints the figures."""
from launch.local import python


def test_dp2_tp2_pp2_matches_one_process_and_the_app_runs():
    r = python(["benchmarks/mesh_2x2x2.py", "--app"], timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "parity: OK" in r.stdout and "main.py on the mesh: exit 0" in r.stdout, r.stdout[-2000:]
