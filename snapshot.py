"""Snapshots: atomic, checksummed, sharded (DCP) and loadable into any strategy or world size.

Layout of `<run_dir>/snapshots/`:

    step_000500/            one complete snapshot (visible only once it is complete)
        .metadata           DCP's index of every tensor shard
        __<rank>_0.distcp   DCP data files, one or more per rank
        meta.json           step, config + fingerprint, tokenizer, scheduler, scaler, tracker id,
                            world size, strategy, and the size + sha256 of every file above
    .tmp-step_000600/       a snapshot being written (ignored and cleaned up)

Writing: every rank writes its shards into the temp folder (dcp.save, a collective), rank 0
hashes the files into meta.json, then renames the folder into place: one rename, after all ranks
finished. A kill at any moment leaves the older snapshots as they were. Older snapshots beyond
`trainer.keep_snapshots` are deleted only after the new one is in place.

Loading: rank 0 walks the snapshots newest first and takes the first whose meta.json parses and
whose files match their recorded sizes and hashes (a damaged one is skipped with a warning), then
broadcasts its choice so every rank loads the same one. Nothing is unpickled: tensors come from
DCP, everything else from JSON.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from config import UsageError

META = "meta.json"
FORMAT_VERSION = 1


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def validate_snapshot(path: Path) -> tuple[dict | None, str]:
    """(meta, "") for a complete, undamaged snapshot, else (None, reason)."""
    meta_path = path / META
    if not meta_path.is_file():
        return None, "no meta.json (incomplete)"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, "meta.json is damaged"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "files" not in meta:
        return None, "meta.json is not a snapshot record of this version"
    for name, rec in meta["files"].items():
        f = path / name
        if not f.is_file():
            return None, f"missing file {name}"
        if f.stat().st_size != rec["size"]:
            return None, f"file {name} has the wrong size (truncated?)"
        if _file_digest(f) != rec["sha256"]:
            return None, f"file {name} fails its checksum"
    if ".metadata" not in meta["files"]:
        return None, "no DCP metadata"
    return meta, ""


def list_snapshots(snap_dir: Path) -> list[Path]:
    """Complete snapshot folders, newest step first (temp folders are never listed)."""
    if not snap_dir.is_dir():
        return []
    found = []
    for p in snap_dir.iterdir():
        if p.is_dir() and p.name.startswith("step_"):
            try:
                found.append((int(p.name[5:]), p))
            except ValueError:
                continue
    return [p for _, p in sorted(found, reverse=True)]


@dataclass
class SnapshotManager:
    run_dir: Path
    keep: int
    rank: int = 0
    distributed: bool = False

    @property
    def snap_dir(self) -> Path:
        return self.run_dir / "snapshots"

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _broadcast(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------------ save

    def save(self, step: int, tensors: dict, meta: dict) -> Path:
        """Collective: every rank calls it with its own shard of `tensors`; rank 0's `meta` is
        recorded. Returns the final folder."""
        final = self.snap_dir / step_dir_name(step)
        tmp = self.snap_dir / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            self.snap_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        self._barrier()
        with _quiet_single_process():
            dcp.save(tensors, checkpoint_id=str(tmp), no_dist=not self.distributed)
        _fault_point("save", step, self.rank)
        self._barrier()  # every rank's shards are on disk
        if self.rank == 0:
            files = {}
            for f in sorted(tmp.iterdir()):
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
                    files[f.name] = {"size": f.stat().st_size, "sha256": _file_digest(f)}
            _write_json_atomic(tmp / META, {**meta, "format": FORMAT_VERSION, "step": step, "files": files})
            _fsync_dir(tmp)
            if final.exists():  # a re-save of the same step (e.g. resumed and saved again)
                shutil.rmtree(final)
            os.rename(tmp, final)  # the commit point
            _fsync_dir(self.snap_dir)
            self._prune()
        self._barrier()
        return final

    def _prune(self) -> None:
        for old in list_snapshots(self.snap_dir)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.snap_dir.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------ load

    def find_latest(self) -> tuple[Path, dict] | None:
        """Newest valid snapshot, agreed by all ranks (rank 0 decides, then broadcasts)."""
        choice = None
        if self.rank == 0:
            for path in list_snapshots(self.snap_dir):
                meta, why = validate_snapshot(path)
                if meta is not None:
                    choice = (str(path), meta)
                    break
                warnings.warn(f"skipping snapshot {path}: {why}", stacklevel=2)
        choice = self._broadcast(choice)
        return (Path(choice[0]), choice[1]) if choice else None

    def has_any(self) -> bool:
        return bool(list_snapshots(self.snap_dir))

    @staticmethod
    def stored_keys(path: Path) -> set[str]:
        """Flattened keys present in a snapshot's DCP metadata (e.g. 'rng.rank0')."""
        md = dcp.FileSystemReader(str(path)).read_metadata()
        return set(md.state_dict_metadata.keys())

    def load(self, path: Path, tensors: dict) -> None:
        """Collective: fill `tensors` (a template with this rank's shapes/shardings) in place."""
        try:
            with _quiet_single_process():
                dcp.load(tensors, checkpoint_id=str(path), no_dist=not self.distributed)
        except Exception as e:  # shapes or keys that do not fit this model
            raise UsageError(f"snapshot {path} does not fit this model/optimizer ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]}); use the config it was trained with "
                             f"or another trainer.run_dir") from None


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save/load that it 'assumes' one process; here that is
    the intent, so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable")
        yield


def _fault_point(where: str, step: int, rank: int) -> str | None:
    """Fault injection for the tests, MINGPT_FAULT=ACTION:WHERE:STEP:RANK (STEP may be '*'), on
    the first launch attempt only, so a restarted group can finish. Actions done here: `kill`
    SIGKILLs that rank (e.g. at WHERE=save: right after it wrote its shards of snapshot STEP, the
    folder still temporary); `term` sends it a real SIGTERM at that moment. Any other matching
    action is returned for the caller to do (trainer.py: `nan` at WHERE=update)."""
    spec = os.environ.get("MINGPT_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    action, at, at_step, at_rank = spec.split(":")
    if at != where or at_step not in ("*", str(step)) or int(at_rank) != rank:
        return None
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        print(f"[fault] rank {rank} sends itself SIGTERM at {where} of step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    return action


def _cuda_in_use() -> bool:
    """Does this process draw random numbers on a CUDA device (dropout on GPU)?"""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def rng_state() -> dict[str, torch.Tensor]:
    """This process's generator states: the CPU one, and the current CUDA device's when CUDA is in
    use (dropout on GPU draws from it; without it a resumed GPU run replays step 0's masks)."""
    state = {"cpu": torch.get_rng_state()}
    if _cuda_in_use():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and _cuda_in_use():
        torch.cuda.set_rng_state(state["cuda"])
