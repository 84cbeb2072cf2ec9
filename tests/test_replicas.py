"""Silent data corruption is caught: a bit flipped in one replica's weight stops the run before the
next snapshot, with one line naming the rank and the tensor, exit 1, and the previous snapshot as
the resume point. The flip is real (`MINGPT_FAULT=flip:update:STEP:RANK` flips one bit of the
rank's first LayerNorm weight in memory after that update); training goes on unaware, as it would
after a flip in a host's memory.
"""
from __future__ import annotations

import pytest
import torch

from guards.replicas import fingerprint
from snapshots.store import list_snapshots, validate_snapshot
from testing.local import TINY, torchrun

COMMON = TINY + ["trainer.max_steps=20", "trainer.save_every=5", "optimizer.lr_decay_steps=20"]


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error: training stopped: replicas disagree")]


def only_snapshot_5(run) -> bool:
    found = list_snapshots(run / "snapshots")
    return [p.name for p in found] == ["step_0000005"] and validate_snapshot(found[0])[0] is not None


def test_one_flipped_bit_changes_the_fingerprint():
    t = torch.randn(1000)
    flipped = t.clone()
    flipped.view(torch.int32)[123] ^= 1 << 3  # a low mantissa bit: a change of ~1e-7 relative
    assert fingerprint(t) == fingerprint(t.clone()) != fingerprint(flipped)
    odd = torch.randn(1002)[1:]  # 1001 floats at a 4-byte offset: the same sum as an aligned copy
    changed = odd.clone()
    changed.view(torch.int32)[-1] ^= 1 << 30
    assert fingerprint(odd) == fingerprint(odd.clone()) != fingerprint(changed)


@pytest.mark.launch
def test_a_flip_on_one_of_four_ddp_replicas_is_named_before_the_next_snapshot(tmp_path):
    run = tmp_path / "run"
    r = torchrun(4, ["main.py", *COMMON, "parallel.strategy=ddp", "trainer.batch_size=16",
                     f"trainer.run_dir={run}"], timeout=240, MINGPT_FAULT="flip:update:7:1")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    lines = error_lines(r.stderr)
    assert lines and lines[0] == (
        "error: training stopped: replicas disagree at step 10: blocks.0.ln_1.weight on rank 1 differs from the "
        "other 3 replicas over the dp group; nothing of this step was saved and the newest snapshot "
        f"{run / 'snapshots' / 'step_0000005'} stays the resume point; a copy changed without an update (a flipped "
        "bit in memory or on the wire): check that host (ECC errors, dmesg) and relaunch"), out[-3000:]
    assert out.count("Traceback") == out.count("ChildFailedError: ") <= 1  # torchrun's own, none of ours
    assert only_snapshot_5(run)


@pytest.mark.launch
def test_a_flip_in_a_tensor_parallel_replica_is_caught(tmp_path):
    """tp=2 replicates the LayerNorm weights over the tp group: two copies, so both ranks are named.
    The flip comes after the update of step 10, just before its save: a flipped replicated weight
    feeds one tp rank's activations, so within a step every tensor tp replicates differs too (a flip
    at step 7 is reported at step 10 as tok_emb.weight and 79 more)."""
    run = tmp_path / "run"
    r = torchrun(2, ["main.py", *COMMON, "parallel.tp=2", f"trainer.run_dir={run}"], timeout=240,
                 MINGPT_FAULT="flip:update:10:1")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    lines = error_lines(r.stderr)
    assert lines and lines[0].startswith(
        "error: training stopped: replicas disagree at step 10: blocks.0.ln_1.weight differs between ranks 0 and 1 "
        "over the tp group (no majority copy)"), out[-3000:]
    assert only_snapshot_5(run)
