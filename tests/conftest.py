"""pytest set-up: offline tiktoken, one torch thread per process, and the suite's device
(MINGPT_TEST_DEVICE, launch/local.py): a session that asks for a device this machine lacks fails
at once with one line, before any test runs (never a skip). pytest.ini puts the repository and
tests/ on sys.path."""
import os
import subprocess
from pathlib import Path

import pytest
import torch

from harness import device_problem
from launch.local import CORPUS, TIKTOKEN_DIR, TINY, device_env, python, torchrun

os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_DIR))
# Before CUDA starts in this process (it starts lazily): the tests that train in this process see
# the same device environment as their torchrun children (launch.local.child_env).
os.environ.update(device_env())
os.environ["WANDB_MODE"] = "offline"
os.environ.pop("WANDB_API_KEY", None)

torch.set_num_threads(1)


def pytest_configure(config):
    problem = device_problem()
    if problem:
        raise pytest.UsageError(problem)  # pytest prints "ERROR: <problem>" and exits with status 4


@pytest.fixture(scope="session")
def corpus() -> Path:
    assert CORPUS.is_file(), f"test corpus missing: {CORPUS} (the shared/ folder beside the repo)"
    return CORPUS


@pytest.fixture(scope="session", autouse=True)
def _relocated_peak_cache(tmp_path_factory):
    """The measured CPU peaks (perf.py) go to a file of this session, not the user's ~/.cache: a peak
    measured on a machine busy with tests must not stay behind as the user's."""
    os.environ["MINGPT_PEAK_CACHE"] = str(tmp_path_factory.mktemp("peak") / "peak-flops.json")


# The fault tests' reference run: ddp over 2 processes, 20 steps, a snapshot every 5, the cosine's
# length fixed (a run resumed at any step follows the same LR curve), and a 3 s hang timeout (which
# changes no number, and must not fire on its steps, evaluations and saves). Every test that ends a
# faulted run bit-identical to an uninterrupted one compares with this one run.
DDP_REFERENCE = TINY + ["parallel.strategy=ddp", "trainer.max_steps=20", "trainer.save_every=5",
                        "optimizer.lr_decay_steps=20", "trainer.hang_timeout_s=3"]


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ddp_reference") / "run"
    r = torchrun(2, ["main.py", *DDP_REFERENCE, f"trainer.run_dir={run}"], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not (run / "hang").exists()  # no false alarm of the hang watchdog on steps, evaluation, saves
    return run


# The longer reference of the kill and stop tests: ddp over 2 processes, 120 steps of a wider
# model (a signal or a kill lands mid-training), a snapshot every 10 steps, the cosine over all 120
# (a resume at the wrong point of the schedule changes the result). Snapshots change no number, so
# the tests whose runs save at other steps (or only when stopped) compare with it too.
LONG_DDP_REFERENCE = TINY + ["parallel.strategy=ddp", "model.n_embd=64", "trainer.max_steps=120",
                             "trainer.save_every=10", "trainer.log_every=10", "trainer.eval_every=40",
                             "trainer.sample_tokens=0"]


@pytest.fixture(scope="session")
def long_ddp_reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("long_ddp_reference") / "run"
    r = torchrun(2, ["main.py", *LONG_DDP_REFERENCE, f"trainer.run_dir={run}"], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return run


@pytest.fixture(scope="session")
def eight_processes(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """benchmarks/mesh_2x2x2.py --app: ONE 8-process launch (its start-up alone is ~30 s on 2
    cores) for the 3-D mesh's parity and two whole-app runs: on the mesh (DIR/app) and with the
    default config (DIR/default). Returns the benchmark's output and DIR (with launch.out)."""
    out = tmp_path_factory.mktemp("eight_processes")
    return python(["benchmarks/mesh_2x2x2.py", "--app", "--keep", str(out)], timeout=420), out
