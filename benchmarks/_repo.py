"""The repository root on sys.path, for `python benchmarks/NAME.py` (which puts benchmarks/ there,
not the repository). A benchmark imports this module before any of the project's: `from _repo
import REPO`, or `import _repo` when it needs no REPO. Never tests/: what a benchmark shares with
the tests is library code (testing/local.py, testing/multinode.py, testing/parity.py)."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
