"""The full 3-D mesh in CI: dp=2 x tp=2 x pp=2 on 8 processes matches one process
(first-step gradients, loss at each of 6 steps, val loss), HSDP x tp does too, and main.py
trains, evaluates and writes model.pt on that mesh. Runs benchmarks/mesh_2x2x2.py (the session's
one 8-process launch, conftest.eight_processes), which prints the figures."""


def test_dp2_tp2_pp2_matches_one_process_and_the_app_runs(eight_processes):
    r, _ = eight_processes
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "parity: OK" in r.stdout and "main.py on the mesh: exit 0" in r.stdout, r.stdout[-2000:]
