"""Snapshots: atomic, checksummed, sharded (DCP) and loadable into any strategy or world size.

Layout of `<run_dir>/snapshots/`:

    step_000500/            one complete snapshot (visible only once it is complete)
        .metadata           DCP's index of every tensor shard
        __<rank>_0.distcp   DCP data files, one or more per rank
        meta.json           step, config + fingerprint, tokenizer, data position, scaler, tracker id,
                            world size, strategy, the optimizer's param groups (nontensor_state),
                            and the size + sha256 of every file above
    .tmp-step_000600/       a snapshot being written (ignored and cleaned up)
    damaged/step_000700/    a damaged snapshot, moved aside (never loaded, never deleted)

Writing: every rank writes its shards into the temp folder (dcp.save, a collective), rank 0
hashes the files into meta.json, then renames the folder into place: one rename, after all ranks
finished (snapshots/writer.py). A kill at any moment leaves the older snapshots as they were. A
write the storage refuses on any rank (full, read-only, no permission, an I/O error) becomes one
StorageError on every rank alike: DCP gathers each rank's failure to every rank, and rank 0's own
steps (the temp folder, meta.json, the rename) broadcast their outcome, so no rank is left waiting
in a collective. The failed temp folder is removed and nothing is pruned. Older snapshots beyond
the `trainer.keep_snapshots` newest valid ones are deleted only after the new one is in place.
Leftover temp folders (a killed save's) are removed when the next save starts.

Loading: rank 0 walks the snapshots newest first and takes the first valid one
(snapshots/format.py; a damaged one is skipped with a warning), then
broadcasts its choice so every rank loads the same one. A damaged snapshot is never counted by
pruning (the newest valid one is never deleted) and is moved aside into `snapshots/damaged/` at
the next save, not deleted.

Nothing is unpickled: DCP holds only tensors (read with torch.load(weights_only=True)); the
non-tensor state (optimizer param groups) goes to meta.json; DCP's own `.metadata` index is a
pickle, so it is read by an unpickler that admits only the classes of DCP's Metadata
(snapshots/format.py), and a snapshot whose index names anything else, or non-tensor (BYTE_IO)
entries, counts as damaged.

`SnapshotMeta` is the run's record in meta.json (what the Trainer writes and reads back, and what
export.py and sample.py rebuild a model from); the file list, format version and param groups
around it are this module's own.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from config import UsageError
from observe import hooks
from snapshots.format import (
    FORMAT_VERSION,
    META,
    SafeReader,
    SnapshotMeta,
    UnsafeSnapshot,
    list_snapshots,
    merge_ranks,
    other_format_refusal,
    put_rest,
    read_dcp_metadata,
    split_state,
    step_dir_name,
    validate_snapshot,
)
from snapshots.writer import BackgroundSaves, SaveTiming, SnapshotWriter, rename_into_place, write_record
from storage.failures import StorageError, error_words, os_error_in, room_problem

DAMAGED = "damaged"  # snapshots/damaged/<name>: damaged snapshots moved aside, never loaded


def load_tensors(path: Path, state: dict, distributed: bool = False) -> None:
    """Fill the tensors of `state` in place from the snapshot at `path` (a collective when
    `distributed`), through SafeReader. Keys of the snapshot that `state` lacks are not read."""
    read_dcp_metadata(path)  # a clear UnsafeSnapshot here, rather than one wrapped by DCP
    with _quiet_single_process():
        dcp.load(state, storage_reader=SafeReader(str(path)), no_dist=not distributed)


@dataclass
class LatestSnapshot:
    """Rank 0's verdict on the snapshots folder, broadcast to every rank: the newest valid
    snapshot and its record, a refusal (a snapshot of another format), or neither (start fresh)."""
    path: str | None = None
    record: dict | None = None
    refusal: str | None = None


@dataclass
class SnapshotManager:
    run_dir: Path
    keep: int
    rank: int = 0
    distributed: bool = False
    # Rank 0's verdicts of this launch (folder name -> reason; "" = valid): pruning hashes a
    # snapshot at most once per launch (the ones it wrote or find_latest checked: never).
    _verdicts: dict[str, str] = field(default_factory=dict)
    _reported: set[str] = field(default_factory=set)  # damaged ones already warned about
    newest: Path | None = None  # the newest valid snapshot (resumed from or written): the resume point
    background: bool = False  # trainer.async_save: write and commit on a thread (snapshots/writer.py)
    _saves: BackgroundSaves | None = None
    _in_flight: Path | None = None  # the final folder of the background save not yet waited for
    _timing: SaveTiming | None = None  # the newest finished save's, not yet logged

    def __post_init__(self):
        if self.background:
            self._saves = BackgroundSaves(self.rank, self.distributed, self._commit_and_prune)

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

    def _verdict(self, path: Path) -> str:
        if path.name not in self._verdicts:
            self._verdicts[path.name] = validate_snapshot(path)[1]
        return self._verdicts[path.name]

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict, meta: SnapshotMeta) -> Path:
        """Collective: every rank calls it with its own shard of `state`; rank 0's `meta` is
        recorded. Tensors go to DCP; the rest (optimizer param groups), merged over the ranks
        (pipeline stages hold different parameters), to meta.json. Returns the final folder.
        A write the storage refuses on any rank (full, read-only, no permission, an I/O error)
        raises the same StorageError on every rank: the temporary folder is removed, nothing is
        pruned, and the newest valid snapshot stays as it was."""
        final = self.snap_dir / step_dir_name(step)
        tmp = self.snap_dir / f".tmp-{step_dir_name(step)}"
        tensors, rest = split_state(state)
        record = {**meta.to_dict(), "format": FORMAT_VERSION, "step": step,
                  "nontensor_state": self._merged_over_ranks(rest) or {}}
        if self._saves is not None:
            return self._save_in_background(step, tensors or {}, tmp, final, record)
        start = time.perf_counter()
        try:
            self._on_rank0(lambda: self._prepare(tmp))
            with _quiet_single_process():  # DCP gathers every rank's failure to every rank
                dcp.save(tensors or {}, storage_writer=SnapshotWriter(tmp, step, self.rank),
                         no_dist=not self.distributed)
            hooks.at("save", step, self.rank)
            self._barrier()  # every rank's shards are on disk
            self._on_rank0(lambda: self._commit(tmp, final, record))
        except (OSError, CheckpointException) as e:
            cause = os_error_in(e)
            if cause is None:
                raise
            if self.rank == 0:  # its partial files would hold space a relaunch needs
                shutil.rmtree(tmp, ignore_errors=True)
            raise StorageError(f"snapshot step {step}", self.snap_dir, cause, self.newest) from None
        self.newest = final
        if self.rank == 0:
            self._prune(final)
        self._barrier()
        ms = 1000 * (time.perf_counter() - start)
        self._timing = SaveTiming(step, ms, ms)
        return final

    def _save_in_background(self, step: int, tensors: dict, tmp: Path, final: Path, record: dict) -> Path:
        """Collective. Wait for the save in flight, then start this one (snapshots/writer.py)."""
        self.finish_background()
        try:
            self._on_rank0(lambda: self._prepare(tmp))
        except OSError as e:
            raise StorageError(f"snapshot step {step}", self.snap_dir, e, self.newest) from None
        self._saves.start(step, tensors, tmp, final, record)
        self._in_flight = final
        return final

    def finish_background(self) -> None:
        """Collective. Wait for the background save in flight (none: nothing to do); StorageError
        on every rank if it failed. The snapshot it wrote is then the resume point."""
        if self._saves is None or self._in_flight is None:
            return
        final, self._in_flight = self._in_flight, None
        self._timing = self._saves.wait(self.newest, self.snap_dir)
        self.newest = final

    def drain(self) -> None:
        """Not collective: let a background save in flight end on this rank (a launch ending on an
        error; every rank drains, so DCP's own collectives complete)."""
        if self._saves is not None:
            self._saves.drain()

    def pop_timing(self) -> dict:
        """The newest finished save's save_blocking_ms and save_total_ms for the next metrics row
        (a background save's once waited for, at the next save or the end), then nothing."""
        t, self._timing = self._timing, None
        return {} if t is None else {"save_step": t.step, "save_blocking_ms": t.blocking_ms, "save_total_ms": t.total_ms}

    def _commit_and_prune(self, tmp: Path, final: Path, record: dict) -> None:
        """Rank 0, on the background save's thread once every rank's files are written."""
        self._commit(tmp, final, record)
        self._prune(final)

    def _merged_over_ranks(self, rest):
        """Rank 0: every rank's non-tensor state as one record (merge_ranks); others: their own."""
        if not self.distributed:
            return rest
        everyone = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(rest, everyone, dst=0)
        if self.rank == 0:
            for other in everyone[1:]:
                rest = merge_ranks(rest, other)
        return rest

    def _on_rank0(self, fn) -> None:
        """fn() on rank 0, then its outcome on every rank: each raises the exception rank 0 met,
        so no rank waits in a later collective for a rank that failed."""
        failure = None
        if self.rank == 0:
            try:
                fn()
            except Exception as e:
                failure = e
        failure = self._broadcast(failure)
        if failure is not None:
            raise failure

    def _prepare(self, tmp: Path) -> None:
        """Rank 0: an empty temporary folder; a killed or failed save's leftovers go first (this
        launch holds the run folder, so any temporary folder is stale) to make room."""
        self.snap_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.snap_dir.glob(".tmp-*"):
            shutil.rmtree(stale)
        tmp.mkdir()

    def _commit(self, tmp: Path, final: Path, record: dict) -> None:
        """Rank 0: meta.json, then the rename that makes `tmp` the snapshot `final`."""
        write_record(tmp, record)
        if final.exists() and self._verdict(final) != "":  # a damaged one skipped on resume
            self._move_aside(final)
        rename_into_place(tmp, final)  # the commit point
        self._verdicts[final.name] = ""

    def _move_aside(self, path: Path) -> None:
        """snapshots/<name> -> snapshots/damaged/<name> (a numbered name if that is taken)."""
        if path.name not in self._reported:  # one warning per damaged snapshot
            warnings.warn(f"damaged snapshot {path}: {self._verdict(path)}; moved to "
                          f"{self.snap_dir / DAMAGED}", stacklevel=3)
            self._reported.add(path.name)
        aside = self.snap_dir / DAMAGED
        aside.mkdir(exist_ok=True)
        target, n = aside / path.name, 1
        while target.exists():
            target, n = aside / f"{path.name}.{n}", n + 1
        os.rename(path, target)

    def _prune(self, final: Path) -> None:
        """Keep the `keep` newest VALID snapshots (the one just written is one, so the newest
        valid one is never deleted). Damaged ones are moved aside, not counted; the rest, older
        than the kept ones, are deleted (unchecked: they go either way). Runs only after a
        commit; a storage error here is one warning, since `final` is complete."""
        kept = 0
        try:
            for path in list_snapshots(self.snap_dir):
                if self._verdicts.get(path.name):  # known damaged (skipped on resume)
                    self._move_aside(path)
                elif kept >= self.keep:
                    shutil.rmtree(path, ignore_errors=True)
                elif self._verdict(path) == "":
                    kept += 1
                else:
                    self._move_aside(path)
        except OSError as e:
            warnings.warn(f"pruning {self.snap_dir} stopped ({error_words(e)}); snapshot {final} is "
                          f"complete, older ones may stay until the next save", stacklevel=3)

    # ------------------------------------------------------------------ load

    def find_latest(self) -> tuple[Path, dict] | None:
        """Newest valid snapshot, agreed by all ranks (rank 0 decides, then broadcasts). A
        snapshot of another format is refused (UsageError on every rank), not skipped."""
        latest = LatestSnapshot()
        if self.rank == 0:
            for path in list_snapshots(self.snap_dir):
                meta, why = validate_snapshot(path)
                self._verdicts[path.name] = why
                if meta is not None:
                    latest = LatestSnapshot(path=str(path), record=meta)
                    break
                refusal = other_format_refusal(path)
                if refusal:  # not damaged: another version's; skipping it would start over
                    latest = LatestSnapshot(refusal=refusal)
                    break
                warnings.warn(f"skipping snapshot {path}: {why} (moved to {self.snap_dir / DAMAGED} "
                              f"at the next save)", stacklevel=2)
                self._reported.add(path.name)
        latest = self._broadcast(latest)
        if latest.refusal:
            raise UsageError(latest.refusal)
        if not latest.path:
            return None
        self.newest = Path(latest.path)
        return self.newest, latest.record

    def has_any(self) -> bool:
        return bool(list_snapshots(self.snap_dir))

    def check_room(self) -> None:
        """Collective, before training goes on from a snapshot: StorageError on every rank when
        the snapshots folder cannot take one more of its size (read-only, not writable, or less
        free space, counting the stale temporary folders the next save removes). A relaunch, or a
        torchrun restart, onto a disk that is still full stops here in seconds instead of training
        up to the save that fails again."""
        problem = None
        if self.rank == 0 and self.newest is not None:
            try:
                meta = json.loads((self.newest / META).read_text(encoding="utf-8"))
                need = sum(rec["size"] for rec in meta["files"].values()) + (self.newest / META).stat().st_size
                problem = room_problem(self.snap_dir, need, self.snap_dir.glob(".tmp-*"))
            except OSError as e:  # the storage fails the check itself: every rank must hear it
                problem = e, ""
        problem = self._broadcast(problem)
        if problem is not None:
            error, detail = problem
            raise StorageError("the next snapshot", self.snap_dir, error, self.newest, detail)

    @staticmethod
    def stored_keys(path: Path) -> set[str]:
        """Flattened keys present in a snapshot's DCP metadata (e.g. 'rng.rank0')."""
        return set(read_dcp_metadata(path).state_dict_metadata.keys())

    def load(self, path: Path, state: dict, meta: dict | None = None) -> None:
        """Collective: fill `state` (a template with this rank's shapes/shardings) in place:
        tensors from DCP, the rest from meta.json's record (`meta`, or read from `path`)."""
        if meta is None:
            meta = json.loads((path / META).read_text(encoding="utf-8"))
        tensors, _ = split_state(state)
        try:
            load_tensors(path, tensors or {}, self.distributed)
            put_rest(state, meta.get("nontensor_state", {}))
        except (Exception, CheckpointException) as e:  # shapes or keys that do not fit this model
            cause = _first_cause(e)
            if isinstance(cause, UnsafeSnapshot):  # it changed after rank 0 validated it
                raise UsageError(f"snapshot {path} is unsafe to load ({cause}); move it out of "
                                 f"{self.snap_dir}") from None
            raise UsageError(f"snapshot {path} does not fit this model/optimizer ({type(cause).__name__}: "
                             f"{str(cause).splitlines()[0][:200]}); use the config it was trained with "
                             f"or another trainer.run_dir") from None


def _first_cause(e: BaseException) -> BaseException:
    """The exception behind DCP's CheckpointException (which wraps each rank's as (exc, trace))."""
    if isinstance(e, CheckpointException) and e.failures:
        return next(iter(e.failures.values()))[0]
    return e


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save/load that it 'assumes' one process; here that is
    the intent, so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable")
        yield
