"""The full 3-D mesh in CI: dp=2 x tp=2 x pp=2 on 8 processes matches one process
(testing/parity.py: first-step gradients, loss and gradient norm at each of 6 steps, parameters
after the first and last step; val loss), HSDP x tp does too, and so do cp 2 x tp 2 x pp 2 (ring)
and dp 2 x cp 2 x tp 2 (allgather), and main.py on that mesh trains like
main.py in one process (loss and gradient norm at each log step, the weights in model.pt). Runs
benchmarks/mesh_2x2x2.py (the session's one 8-process launch, conftest.eight_processes), which
prints the figures; the checks are made here, on the figures it keeps, against a one-process run
of this process."""
import json

import pytest

import main as app
from harness import metric_rows, model_tensors
from testing.local import TINY, python
from testing.parity import LOSS_RTOL, NORM_RTOL, PARAM_ATOL, assert_parity, load_case, run_steps

pytestmark = pytest.mark.launch

STEPS = 6  # benchmarks/mesh_2x2x2.py's
MESH = "parallel.strategy=fsdp parallel.tp=2 parallel.pp=2 parallel.pp_schedule=1f1b"


def test_dp2_tp2_pp2_matches_one_process_and_the_app_runs(eight_processes, tmp_path):
    r, out = eight_processes
    assert r.returncode == 0 and "main.py on the mesh: exit 0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    ref = run_steps(["parallel.strategy=none"], STEPS, tmp_path / "ref", evaluate=True)
    mesh = load_case(out, "mesh")
    assert_parity(ref, mesh, "dp2 x tp2 x pp2")
    assert abs(mesh["val_loss"] - ref["val_loss"]) <= 1e-4 * ref["val_loss"], (mesh["val_loss"], ref["val_loss"])
    assert_parity(ref, load_case(out, "hsdp_tp"), "dp_replicate2 x dp_shard2 x tp2")
    # context parallelism inside 3-D meshes: cp 2 x tp 2 x pp 2 (ring), dp 2 x cp 2 x tp 2 (allgather)
    for name in ("cp_tp_pp", "dp_cp_tp"):
        got = load_case(out, name)
        assert_parity(ref, got, name)
        assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-4 * ref["val_loss"], (name, got["val_loss"], ref["val_loss"])
    # the app: main.py on the mesh against main.py in one process, the same config otherwise
    assert json.loads((out / "app_exit_codes.json").read_text())[0] == 0
    one = tmp_path / "one"
    assert app.main(TINY + ["parallel.strategy=none", f"trainer.max_steps={STEPS}", f"trainer.run_dir={one}"]) == 0
    rows, want = metric_rows(out / "app"), metric_rows(one)
    assert [row["step"] for row in rows] == [row["step"] for row in want], rows
    for a, b in zip(want, rows):
        assert abs(a["loss"] - b["loss"]) <= LOSS_RTOL * a["loss"], ("loss", a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= NORM_RTOL * a["grad_norm"], (a["step"], a["grad_norm"], b["grad_norm"])
    ta, tb = model_tensors(one), model_tensors(out / "app")
    assert ta.keys() == tb.keys() and max((ta[k] - tb[k]).abs().max().item() for k in ta) <= PARAM_ATOL


def test_keep_refuses_a_folder_with_files_in_one_line(tmp_path):
    """A second run into the same --keep folder would resume its finished run folders instead of
    training: refused before anything starts, the folder left as it was."""
    (tmp_path / "app").mkdir()
    r = python(["benchmarks/mesh_2x2x2.py", "--app", "--keep", str(tmp_path)], timeout=120)
    assert r.returncode == 2 and r.stderr == f"error: --keep {tmp_path} is not empty: name a new or empty folder\n", r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["app"]
