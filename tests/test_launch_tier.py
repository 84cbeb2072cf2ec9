"""The fast tier's guard (conftest.py): a test without the `launch` marker that starts a process
fails with one line naming the marker, whether it starts it in its body, in a fixture, or on a
path that swallows the error; a marked test starts processes as usual. Nothing here starts a
process: the guard refuses each start before it happens."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from types import ModuleType

import pytest

import conftest
from conftest import no_process_starts

pytest_plugins = ["pytester"]


def fork() -> None:
    if os.fork() == 0:
        os._exit(0)  # reached only if the guard let the fork through: the child must not go on testing


STARTS = {
    "subprocess.Popen": lambda: subprocess.run([sys.executable, "-c", "pass"]),
    "os.system": lambda: os.system("true"),
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], os.environ),
    "os.fork": fork,
    "multiprocessing Process.start": lambda: multiprocessing.get_context("fork").Process(target=int).start(),
}


@pytest.mark.parametrize("what", list(STARTS))
def test_every_way_to_start_a_process_is_refused_naming_the_marker(what):
    with no_process_starts() as refused:
        with pytest.raises(pytest.fail.Exception) as failed:
            STARTS[what]()
    line = str(failed.value)
    assert refused == [line] and "\n" not in line, refused
    assert f"({what} from tests/test_launch_tier.py:" in line, line
    assert "has no `launch` marker: mark it @pytest.mark.launch" in line, line


def test_a_refusal_caught_by_the_code_under_test_is_still_recorded():
    with no_process_starts() as refused:
        try:
            subprocess.run(["true"])
        except BaseException:
            pass
    assert len(refused) == 1 and "subprocess.Popen" in refused[0], refused


INNER = """
import subprocess

import pytest

AS_FOUND = subprocess.Popen.__init__  # at collection, outside any test's guard


@pytest.fixture
def launching():
    subprocess.run(["true"])


def test_in_body():
    subprocess.run(["true"])


def test_swallowed():
    try:
        subprocess.run(["true"])
    except BaseException:
        pass


def test_through_a_fixture(launching):
    pass


def test_in_process():
    assert subprocess.Popen.__init__ is not AS_FOUND  # guarded


@pytest.mark.launch
def test_marked():
    assert subprocess.Popen.__init__ is AS_FOUND  # not guarded
"""


def test_the_session_fails_unmarked_tests_that_start_a_process_and_only_those(pytester, monkeypatch):
    """A pytest session in this process with conftest.py's three hook wrappers, on tests that start
    a process in their body, swallow the refusal, start one in a fixture, start none, and one marked
    test. The marked test would start its process for real; it only checks that it could."""
    hooks = ModuleType("launch_guard")  # a plugin of conftest.py's three hook wrappers, nothing else of it
    for name in ("pytest_runtest_setup", "pytest_runtest_call", "pytest_runtest_teardown"):
        setattr(hooks, name, getattr(conftest, name))
    # no plugin of this environment's (one, pytest-benchmark, runs `file` as it configures)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeini("[pytest]\nmarkers =\n    launch: starts a process\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest("-p", "no:cacheprovider", plugins=[hooks])
    result.assert_outcomes(passed=2, failed=2, errors=1)
    out = result.stdout.str()
    for test, where in (("test_in_body", "test_in_body"), ("test_swallowed", "test_swallowed"),
                        ("test_through_a_fixture", "launching")):
        assert f"this test started a process (subprocess.Popen from {pytester.path}/test_inner.py:" in out, out
        assert f"in {where}) but has no `launch` marker" in out, (test, out)
