"""pytest set-up: offline tiktoken, one torch thread per process, and the suite's device
(MINGPT_TEST_DEVICE, testing/local.py): a session that asks for a device this machine lacks fails
at once with one line, before any test runs (never a skip). pytest.ini puts the repository and
tests/ on sys.path.

The two tiers: a test that starts a process carries the marker `launch` (pytest.ini); the fast tier,
`-m "not launch"`, runs in this process only. The rule is enforced: a test without the marker that
starts a process, in its body or through a fixture, fails at once naming the marker."""
import multiprocessing.process
import os
import subprocess
import traceback
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from harness import device_problem
from testing.local import (
    CORPUS,
    DEVICE_ENV,
    REPO,
    TIKTOKEN_DIR,
    TINY,
    NotEnoughGPUs,
    device_env,
    need_gpus,
    python,
    torchrun,
)

os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_DIR))
# Before CUDA starts in this process (it starts lazily): the tests that train in this process see
# the same device environment as their torchrun children (testing.local.child_env).
os.environ.update(device_env())
os.environ["WANDB_MODE"] = "offline"
# The plan wraps its lines to $COLUMNS when set (planner/render.py); a shell or a machine that
# exports it (a GPU machine did, and 7 tests failed on wrapped lines) must not change what the tests read.
os.environ.pop("COLUMNS", None)
os.environ.pop("WANDB_API_KEY", None)

torch.set_num_threads(1)


def pytest_configure(config):
    problem = device_problem()
    if problem:
        raise pytest.UsageError(problem)  # pytest prints "ERROR: <problem>" and exits with status 4


# ----------------------------------------------------------------------------- the launch tier

LAUNCH = "launch"
# Every way this process can start another: subprocess (subprocess.run, torchrun and python of
# testing/local.py, StreamedLaunch and os.popen go through Popen), the os calls that fork or exec
# without it, and multiprocessing (a Pool or a ProcessPoolExecutor starts Process objects; under
# spawn and forkserver they exec without Popen, so Process.start is where to stop them).
# No exception for application or library code that starts processes in a test's own process:
# torch.compile on the CPU runs g++ and a python per kernel (inductor: 19 processes and ~20 s for a
# function of 3 ops on this 2-core machine), prepare.py's corpus build starts a Pool of workers and
# `main.py --plan` measures this machine with processes of tools/calibrate.py. A test that reaches
# any of them is slow and competes for the cores, so it belongs in the launch tier too.
PROCESS_STARTS = [(subprocess.Popen, "__init__", "subprocess.Popen"),
                  (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start")] + [
    (os, name, f"os.{name}") for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp")
    if hasattr(os, name)]


def launch_refusal(what: str) -> str:
    """The one message of a process start refused to a test without the marker; `what` names the call
    and where in the repository it was made."""
    return (f"this test started a process ({what}) but has no `{LAUNCH}` marker: mark it "
            f"@pytest.mark.{LAUNCH} (or its module: pytestmark = pytest.mark.{LAUNCH}); the fast tier "
            f'(-m "not {LAUNCH}") starts no process')


def _caller() -> str:
    """Where the refused start was asked for: the innermost frame of a test module or a conftest (a
    fixture), else of the repository (a test reached it through the application)."""
    stack = traceback.extract_stack()[:-2]  # less this function and the refusing stand-in
    in_repo = [f for f in stack if Path(f.filename).resolve().is_relative_to(REPO)]
    tests = [f for f in stack if Path(f.filename).name.startswith(("test_", "conftest"))]
    if not (tests or in_repo):
        return "outside the repository"
    frame = (tests or in_repo)[-1]
    path = Path(frame.filename).resolve()
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{frame.lineno} in {frame.name}"


@contextmanager
def no_process_starts():
    """While entered, every process start (PROCESS_STARTS) fails the test with launch_refusal;
    yields the list of refusals, which the caller checks on leaving: a refusal swallowed by an
    `except` or raised on another thread (a background save, a pool) still fails the test."""
    refused: list[str] = []

    def refuse(what: str):
        def start(*args, **kwargs):
            refused.append(launch_refusal(f"{what} from {_caller()}"))
            pytest.fail(refused[-1], pytrace=False)  # BaseException: no `except Exception` swallows it
        return start

    with pytest.MonkeyPatch.context() as patch:
        for owner, name, what in PROCESS_STARTS:
            patch.setattr(owner, name, refuse(what))
        yield refused


def _guarded(item: pytest.Item):
    """The body of the three hook wrappers below: the phase runs under no_process_starts unless the
    test is marked `launch`."""
    if item.get_closest_marker(LAUNCH) is not None:
        return (yield)
    with no_process_starts() as refused:
        result = yield
    if refused:
        pytest.fail(refused[0], pytrace=False)
    return result


# Hook wrappers, not an autouse fixture: session fixtures (ddp_reference, eight_processes) are set up
# before any function-scoped fixture, so only a wrapper of the whole setup phase sees them launch.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guarded(item))


LEFT_OUT: list[str] = []  # a cuda session's tests whose launch needs more GPUs than it has


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A cuda session on fewer GPUs than a launch's ranks: that test is left out (reported as a skip
    naming the GPUs it needs, and listed at the end), the others run. Never on the CPU: there every
    launch fits."""
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(NotEnoughGPUs) and report.failed:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"left out: {call.excinfo.value}")
        LEFT_OUT.append(item.nodeid)
    return report


def pytest_terminal_summary(terminalreporter):
    if LEFT_OUT:
        terminalreporter.write_line(f"{DEVICE_ENV}=cuda left out {len(LEFT_OUT)} tests whose launches need more GPUs "
                                    f"than the {torch.cuda.device_count()} here: {', '.join(LEFT_OUT)}")


# ----------------------------------------------------------------------------- fixtures


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
# length fixed (a run resumed at any step follows the same LR curve), and a 30 s hang timeout (which
# changes no number; its steps, evaluations and saves take well under a second each, so a false alarm
# is a watchdog defect, not a slow machine: a 3 s timeout here failed every test sharing this run
# whenever one step of a loaded 2-core machine took 3 s). Every test that ends a faulted run
# bit-identical to an uninterrupted one compares with this one run; tests/test_hang.py sets 3 s.
DDP_REFERENCE = TINY + ["parallel.strategy=ddp", "trainer.max_steps=20", "trainer.save_every=5",
                        "optimizer.lr_decay_steps=20", "trainer.hang_timeout_s=30"]
# The reference itself saves in the background: the faulted runs that save synchronously (the hang,
# the storage faults) ending bit-identical to it also prove that background saves train the same
# model, with no launch of its own; tests/test_async_save.py checks the reference's snapshots and
# save timings.
DDP_REFERENCE_ASYNC = DDP_REFERENCE + ["trainer.async_save=true"]


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ddp_reference") / "run"
    r = torchrun(2, ["main.py", *DDP_REFERENCE_ASYNC, f"trainer.run_dir={run}"], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not (run / "hang").exists()  # no false alarm of the hang watchdog on steps, evaluation, saves
    return run


# The longer reference of the kill and stop tests: ddp over 2 processes, 120 steps of a wider
# model (a signal or a kill lands mid-training), a snapshot every 10 steps, the cosine over all 120
# (a resume at the wrong point of the schedule changes the result). Snapshots change no number, so
# the tests whose runs save at other steps (or only when stopped) compare with it too.
LONG_STEPS = 120
LONG_DDP_REFERENCE = TINY + ["parallel.strategy=ddp", "model.n_embd=64", f"trainer.max_steps={LONG_STEPS}",
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
    need_gpus(8)  # a cuda session on fewer GPUs leaves its tests out
    out = tmp_path_factory.mktemp("eight_processes")
    return python(["benchmarks/mesh_2x2x2.py", "--app", "--keep", str(out)], timeout=420), out
