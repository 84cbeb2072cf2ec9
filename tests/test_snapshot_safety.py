"""Snapshot integrity, by really damaging and really tampering with the
files of a trained run and running the app, export.py and sample.py on it:

- damaged snapshots newer than the resume point (a flipped byte, a truncated data file, no
  meta.json, a meta.json that is not JSON) are never counted by pruning, are moved aside into
  snapshots/damaged/ with one warning each naming what is wrong, and the launch resumes from the
  newest valid one;
- a crafted DCP `.metadata` pickle, or a crafted non-tensor (BYTE_IO) entry, with their sha256
  updated in meta.json so that only the unpickling guard can stop them, never run their payload
  on resume, export or sample;
- a snapshot of the older format (pickled param groups) is refused with one line, touching nothing.

Starts no process (fast tier): every test runs the app in this process, on a copy of one 6-step run.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import export
import sample
from harness import app_in_process
from testing.local import TINY

ARGS = TINY + ["trainer.sample_tokens=0", "optimizer.lr_decay_steps=20", "parallel.strategy=none",
               "trainer.save_every=1"]


train = app_in_process(ARGS)


def snap(run: Path, step: int) -> Path:
    return run / "snapshots" / f"step_{step:07d}"


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run with snapshots at steps 1..6 (each test damages a copy)."""
    run = tmp_path_factory.mktemp("safety") / "run"
    assert train(run, "trainer.max_steps=6", "trainer.keep_snapshots=6") == 0
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def test_damaged_snapshots_are_moved_aside_and_never_counted(run, capsys):
    flipped = next(snap(run, 6).glob("*.distcp"))
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    truncated = next(snap(run, 5).glob("*.distcp"))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    (snap(run, 4) / "meta.json").unlink()
    (snap(run, 3) / "meta.json").write_text("{not json")  # damaged, not another format: skipped, not refused
    damaged = {s: files_of(snap(run, s)) for s in (3, 4, 5, 6)}
    why = {6: f"file {flipped.name} fails its checksum", 5: f"file {truncated.name} has the wrong size (truncated?)",
           4: "no meta.json (incomplete)", 3: "meta.json is damaged"}
    snaps = run / "snapshots"

    # Resumes from step 2, writes steps 3 and 4 (where damaged ones lie) with keep_snapshots=1.
    with pytest.warns(UserWarning) as caught:
        assert train(run, "trainer.max_steps=4", "trainer.keep_snapshots=1") == 0
    assert f"resumed from {snap(run, 2)} at step 2" in capsys.readouterr().out
    about = [str(w.message) for w in caught if "snapshot" in str(w.message)]
    # one warning per damaged snapshot, naming it and what is wrong with it; none about the good ones
    assert sorted(about) == sorted(f"skipping snapshot {snap(run, s)}: {why[s]} (moved to {snaps / 'damaged'} at "
                                   f"the next save)" for s in why), about
    assert sorted(p.name for p in snaps.iterdir()) == ["damaged", "step_0000004"]
    for s in (3, 4, 5, 6):  # moved, byte for byte, not deleted
        assert files_of(snaps / "damaged" / f"step_{s:07d}") == damaged[s]

    # The next launch resumes from the newest valid snapshot, with nothing left to warn about.
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        assert train(run, "trainer.max_steps=5", "trainer.keep_snapshots=1") == 0
    assert not [str(w.message) for w in later if "snapshot" in str(w.message)]
    assert "step_0000004 at step 4" in capsys.readouterr().out
    assert sorted(p.name for p in snaps.iterdir()) == ["damaged", "step_0000005"]


# ----------------------------------------------------------------------------- unpickling

class Payload:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('payload ran')",)


def rehash(snapshot: Path) -> None:
    """What an attacker does so that the checksums pass: record the tampered files in meta.json."""
    meta = json.loads((snapshot / "meta.json").read_text())
    for f in snapshot.iterdir():
        if f.name != "meta.json":
            meta["files"][f.name] = {"size": f.stat().st_size,
                                     "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    (snapshot / "meta.json").write_text(json.dumps(meta))


def plant_metadata_payload(snapshot: Path, marker: Path) -> None:
    (snapshot / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def plant_entry_payload(snapshot: Path, marker: Path) -> None:
    """Non-tensor (BYTE_IO) entries that DCP reads with torch.load(weights_only=False): a model
    weight (read by resume, export and sample) and an optimizer param-group value."""
    with open(snapshot / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own, just-written file
    payload = snapshot / "__0_1.distcp"
    torch.save(Payload(marker), payload)
    for key in ("model.tok_emb.weight", "optim.param_groups.0.lr"):
        md.state_dict_metadata[key] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(key)] = _StorageInfo(payload.name, 0, payload.stat().st_size)
    with open(snapshot / ".metadata", "wb") as f:
        pickle.dump(md, f)


def outcome(fn, *args):
    """fn's return value, or the exception it raised: the marker is checked either way."""
    try:
        return fn(*args)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        return e


@pytest.mark.parametrize("plant", [plant_metadata_payload, plant_entry_payload], ids=["metadata", "entry"])
def test_crafted_snapshot_runs_nothing_on_resume_export_or_sample(run, tmp_path, plant, capsys):
    marker = tmp_path / "payload-ran"
    plant(snap(run, 6), marker)
    rehash(snap(run, 6))
    capsys.readouterr()

    rc = outcome(export.main, ["--run-dir", str(run), "--step", "6"])  # named by the user
    assert not marker.exists(), "export unpickled the payload"
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and "step_0000006" in err[0], (rc, err)

    rc = outcome(sample.main, ["--run-dir", str(run), "--snapshot", "--tokens", "5", "--prompt", "A"])
    assert not marker.exists(), "sample unpickled the payload"
    assert rc == 0 and "skipping snapshot" in capsys.readouterr().err  # the newest valid: step 5

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = outcome(train, run, "trainer.max_steps=6", "trainer.keep_snapshots=2")
    assert not marker.exists(), "resume unpickled the payload"
    assert rc == 0 and "at step 5" in capsys.readouterr().out
    assert [str(w.message) for w in caught if "snapshot" in str(w.message)] == [
        next(str(w.message) for w in caught if "skipping snapshot" in str(w.message))]
    assert (run / "snapshots" / "damaged" / "step_0000006").is_dir()


def test_older_format_snapshot_is_refused_and_untouched(run, capsys):
    meta_path = snap(run, 6) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format"] = 1
    meta_path.write_text(json.dumps(meta))
    before = files_of(run)
    capsys.readouterr()
    assert train(run, "trainer.max_steps=8") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "format 1" in err[0], err
    assert export.main(["--run-dir", str(run), "--step", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "format 1" in err[0], err
    assert files_of(run) == before


def test_metadata_reader_refuses_what_dcp_never_writes(trained, tmp_path):
    """The restricted unpickler reads a real index, and refuses a foreign global and a pickle that
    would set attributes on a class (which the C unpickler, with find_class alone, allows)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from snapshots.format import UnsafeSnapshot, read_dcp_metadata

    md = read_dcp_metadata(snap(trained, 6))
    assert md.state_dict_metadata and "model.tok_emb.weight" in md.state_dict_metadata
    crafted = {
        "global": pickle.dumps(Payload(Path("/nonexistent/marker"))),
        # protocol 2: GLOBAL Metadata; state (None, {"pwned": "yes"}); BUILD
        "build_on_class": b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"
                          b"N}X\x05\x00\x00\x00pwnedX\x03\x00\x00\x00yess\x86b.",
    }
    for name, raw in crafted.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / ".metadata").write_bytes(raw)
        with pytest.raises(UnsafeSnapshot):
            read_dcp_metadata(folder)
    assert not hasattr(Metadata, "pwned")


def test_a_resume_parses_the_dcp_index_once_and_again_after_a_change(run, monkeypatch):
    """The restricted unpickler is pure Python: a resume parses the snapshot's index once, not at
    each of its four reads (validation, stored keys, the load's check, DCP's reader); an index
    changed on disk is parsed again."""
    from snapshots import format as dcp_reader
    parses = []
    real_load = dcp_reader._MetadataUnpickler.load
    monkeypatch.setattr(dcp_reader._MetadataUnpickler, "load", lambda self: parses.append(1) or real_load(self))
    assert train(run, "trainer.max_steps=7") == 0  # resumes step 6, trains and saves step 7
    assert len(parses) == 1, f"{len(parses)} parses of one snapshot's index in one resume"
    index = snap(run, 7) / ".metadata"
    md = dcp_reader.read_dcp_metadata(snap(run, 7))
    parsed = len(parses)
    assert dcp_reader.read_dcp_metadata(snap(run, 7)) is md and len(parses) == parsed
    os.utime(index, ns=(index.stat().st_atime_ns, index.stat().st_mtime_ns + 1))
    assert dcp_reader.read_dcp_metadata(snap(run, 7)) is not md and len(parses) == parsed + 1
