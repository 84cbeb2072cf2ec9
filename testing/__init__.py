"""What the tests and the benchmarks share, outside the app's import path: local launches
(local.py), two-node stand-ins (multinode.py), the parity harness (parity.py), and the faults
caused on purpose (faults.py, installed at start-up by boot/sitecustomize.py)."""
