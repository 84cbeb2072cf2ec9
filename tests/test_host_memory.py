"""trainer.host_memory (observe/host_memory.py): lean returns every freed block of 1 MiB or more to
the kernel, so the next step maps and faults it in again; reuse keeps the step's blocks for the next
step. Counted in a fresh process (glibc's settings are the process's), by its minor page faults
over 20 rounds of allocating and freeing 8 MiB (after 8 rounds to warm up): lean faults its 2,048
pages in every round, reuse none; and after reuse the threshold is lean again (a 16 MiB block, below reuse's 32 MiB
threshold but larger than any block the heap freed inside, faults in every round)."""
import json
import subprocess
import sys

import pytest

from testing.local import REPO

pytestmark = pytest.mark.launch

CHILD = """
import json, resource, torch
from observe.host_memory import return_large_frees, reuse_step_memory

def faults_per_round(mib=8, rounds=20):
    for _ in range(8):  # warm up: the heap settles after a few rounds (6 here) of reuse
        torch.empty(mib * 2**18).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        torch.empty(mib * 2**18).fill_(1)  # every page written, then freed
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds / (mib // 8)

assert return_large_frees()
lean = faults_per_round()
with reuse_step_memory(enabled=False):
    off = faults_per_round()
with reuse_step_memory():
    reused = faults_per_round()
# after: a block larger than any the heap freed inside (glibc serves a request from a free heap
# chunk that fits before it looks at the threshold, so an 8 MiB chunk freed inside stays in use)
print(json.dumps({"lean": lean, "reuse": reused, "after": faults_per_round(mib=16), "off": off}))
"""


def test_reuse_keeps_the_step_s_blocks_and_lean_returns_them():
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    pages = 8 * 2**20 // 4096
    assert got["lean"] >= 0.9 * pages and got["after"] >= 0.9 * pages and got["off"] >= 0.9 * pages, got
    assert got["reuse"] <= 0.1 * pages, got
