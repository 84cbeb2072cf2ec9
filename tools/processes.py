"""The processes the tools start on this machine (calibration's pair; the tests and benchmarks
through testing/local.py): the machine-wide lock every multi-process launch holds while it runs,
so two never share the cores or the loopback interface whichever checkout starts them, and the
environment of a local child: one thread, a short process-group timeout, the repository
importable."""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = Path(os.environ.get("MINGPT_TEST_LOCK", "/tmp/mingpt-parallel-multiprocess.lock"))


@contextmanager
def multiprocess_lock():
    """The machine-wide lock every multi-process launch holds while it runs."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def child_env(**extra) -> dict:
    """This process's environment for a local child: one thread (the children share the cores), a
    60 s process-group timeout (a dead peer fails fast), unbuffered output, the repository on
    PYTHONPATH, and `extra`."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MINGPT_PG_TIMEOUT="60", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env
