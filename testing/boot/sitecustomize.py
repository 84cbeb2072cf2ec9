"""Test faults in the processes the tests start, with nothing of the app importing them.

testing/local.py's child_env puts this folder first on PYTHONPATH, and Python imports a
`sitecustomize` module at start-up (https://docs.python.org/3/library/site.html): when
MINGPT_FAULT is set, testing/faults.py's actions go into the hook points of observe/hooks.py
before main.py (or a torchrun worker) runs a line. Without MINGPT_FAULT it imports nothing. A
sitecustomize further down sys.path (a distribution's own) is run after, as if this one were not
here.
"""
import os
import sys
from pathlib import Path

if os.environ.get("MINGPT_FAULT"):
    from testing import faults

    faults.install()

_here = Path(__file__).resolve().parent
for _entry in sys.path:
    _other = Path(_entry or ".").resolve() / "sitecustomize.py"
    if _entry and Path(_entry).resolve() != _here and _other.is_file():
        exec(compile(_other.read_text(encoding="utf-8"), str(_other), "exec"))  # noqa: S102
        break
