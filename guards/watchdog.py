"""The hang watchdog: a rank that stops without dying is named, and the job exits so torchrun can restart it.

A dead worker ends the job at once (torchrun sees it). A rank that stops without dying (a stuck
driver, a deadlock, a filesystem that never answers, a SIGSTOP) leaves every other rank waiting in
its next collective until the process-group timeout (600 s, MINGPT_PG_TIMEOUT; every group of the
launch gets it, parallel/env.py), and nothing says which rank it is. Here every rank runs a thread that watches the step loop's heartbeat
(`beat`: one assignment per step). When no step finishes within `trainer.hang_timeout_s` (times
LONG_PHASE_FACTOR for start-up up to the first step, for the first steps, which may compile, for
evaluation and for snapshot saves; never less than SLOW_STEP_FACTOR x the slowest step so far; never
more than BUDGET_SHARE of the process-group timeout, which on NCCL aborts every rank without a
word), the thread of each live rank:

1. writes its dumps under <run_dir>/hang/attempt<K>/: the Python stack of every thread
   (stacks_rank_<R>.txt) and torch's flight recorders: gloo's (fr_trace_rank_<R>) and on a GPU
   NCCL's (nccl_trace_rank_<R>), each read by
   `python -m torch.distributed.flight_recorder.fr_trace <folder> --prefix fr_trace_rank_`;
2. publishes a short report in the rendezvous store (a connection of its own: the training
   thread may hold the process group's): its step, what it waits in, where, and the last
   collective sequence number it issued on each process group;
3. the first rank to claim it gathers the reports for a few seconds and prints one line that
   names the ranks that did not arrive (no report: stopped, frozen or dead; or a lower sequence
   number: it never entered the collective the others wait in) and where the others wait,
   e.g. `hang: rank 1 (host h1, local rank 1) has not finished step 21 for 31 s and does not
   answer (stopped, frozen or dead); rank 0 waits in all_reduce #84 on default_pg (trainer.py:…)`,
   on stdout and in torchrun's error file;
4. every live rank exits with HANG_EXIT, so `torchrun --max-restarts` restarts the group, which
   resumes from the newest snapshot (torchrun SIGKILLs a stopped rank 30 s after its SIGTERM).

The flight recorder (TORCH_FR_BUFFER_SIZE, set by parallel/env.py before the process group
starts) records every collective with its sequence number; on gloo it records no completion
times and a stopped rank dumps nothing, so the culprit is found by comparing what the live ranks
report. What is not watched: the launch before its Trainer exists (process group, data, model) and
the outputs after the last step.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from parallel.env import pg_timeout, restart_count, side_store, write_error_file

HANG_EXIT = 4
LONG_PHASE_FACTOR = 4  # first steps (compile), evaluation, snapshot saves
SLOW_STEP_FACTOR = 10  # a step this many times the slowest one so far is not yet a hang
FIRST_STEPS = 2  # steps of each launch that may compile (a launch's step count, not the step number)
REPO = Path(__file__).resolve().parent.parent
STORE_TIMEOUT_S = 10.0
BUDGET_SHARE = 0.8  # of the process-group timeout: the watchdog's longest wait (gathering and exit fit in the rest)


def gather_seconds(timeout_s: float) -> float:
    """How long the reporting rank waits for the other ranks' reports: every live rank's watchdog
    fires within about one step of the others (they all stopped at the same collective)."""
    return min(30.0, max(5.0, timeout_s / 4))


@dataclass(frozen=True)
class Beat:
    step: int  # optimizer steps finished
    phase: str  # "start-up" | "first steps" | "train" | "evaluation" | "snapshot"
    at: float  # time.monotonic()


@dataclass
class RankReport:
    """What one live rank says about itself when its watchdog fires."""
    rank: int
    host: str
    local_rank: int
    step: int  # steps finished
    phase: str
    stalled_s: float
    where: str  # the innermost project frame of the training thread: "trainer.py:312 in train"
    waits_in: str  # its newest collective not yet completed ("all_reduce #84 on default_pg"), or ""
    last_seq: dict[str, int] = field(default_factory=dict)  # process group -> last collective issued

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> "RankReport":
        return RankReport(**json.loads(text))


def _recorder_dump(name: str, *args) -> bytes | str | None:
    """torch._C._distributed_c10d.<name>(*args), or None where this build has none (the NCCL ones are
    absent from CPU builds) or it fails."""
    fn = getattr(torch._C._distributed_c10d, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except (RuntimeError, TypeError, ValueError):
        return None


def flight_records() -> list[dict]:
    """The flight recorder's entries of this process, every backend's (empty when it is off). torch
    keeps one recorder per kind of event: gloo's (CPU) collectives in one, NCCL's (CUDA) in another,
    dumped by their own functions; a GPU run has both (the control group is gloo)."""
    entries = []
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        text = _recorder_dump(name, True, False)  # (include collectives, only active)
        try:
            entries += json.loads(text).get("entries", []) if text else []
        except ValueError:
            continue
    return entries


def _group_name(entry: dict) -> str:
    pg_id, desc = (entry.get("process_group") or ["?", "undefined"])[:2]
    return desc if desc not in ("", "undefined") else f"group {pg_id}"


def collective_state(entries: list[dict]) -> tuple[str, dict[str, int]]:
    """(the newest collective not yet completed, last sequence number issued per process group)."""
    last_seq: dict[str, int] = {}
    pending = None
    for e in sorted(entries, key=lambda e: e.get("record_id", 0)):
        if not e.get("retired", True):
            pending = e
        if not e.get("is_p2p"):  # a pipeline's sends and receives are numbered per peer, not per group
            group = _group_name(e)
            last_seq[group] = max(last_seq.get(group, 0), int(e.get("collective_seq_id", 0)))
    if pending is None:
        return "", last_seq
    seq = pending["p2p_seq_id"] if pending.get("is_p2p") else pending["collective_seq_id"]
    return f"{pending['profiling_name'].split(':')[-1]} #{seq} on {_group_name(pending)}", last_seq


def project_frame(frame) -> str:
    """'trainer.py:312 in train': the innermost frame of the project's own code on this stack."""
    for summary in reversed(traceback.extract_stack(frame)):
        path = Path(summary.filename).resolve()
        if path.is_relative_to(REPO) and path != Path(__file__).resolve():
            return f"{path.relative_to(REPO)}:{summary.lineno} in {summary.name}"
    return "outside the project's code"


def compact_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5' (a line must stay a line at 1,024 ranks)."""
    ranks = sorted(ranks)
    spans, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            spans.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def hang_line(reports: dict[int, RankReport], world_size: int, identities: dict[int, tuple[str, int]],
              dumps: Path) -> str:
    """The one line naming who did not arrive and where the others wait (see the module doc)."""
    live = list(reports.values())
    step = max(r.step for r in live) + 1
    stalled = max(r.stalled_s for r in live)
    newest = {g: max(r.last_seq.get(g, 0) for r in live) for r in live for g in r.last_seq}
    behind = {r.rank for r in live if any(r.last_seq.get(g, 0) < s for g, s in newest.items())}
    parts = []
    for rank in sorted(set(range(world_size)) - set(reports)):
        host, local = identities.get(rank, ("?", -1))
        parts.append(f"rank {rank} (host {host}, local rank {local}) has not finished step {step} for "
                     f"{stalled:.0f} s and does not answer (stopped, frozen or dead)")
    for rank in sorted(behind):
        r = reports[rank]
        parts.append(f"rank {rank} (host {r.host}, local rank {r.local_rank}) has not finished step {step} for "
                     f"{stalled:.0f} s and never entered the collective the others wait in: it is at {r.where}"
                     + (f" in {r.phase}" if r.phase != "train" else ""))
    waiting: dict[str, list[int]] = {}
    for r in live:
        if r.rank not in behind:
            waiting.setdefault(f"{r.waits_in or 'no collective'} ({r.where})", []).append(r.rank)
    if not parts:
        in_collectives = all(r.waits_in for r in live)
        parts.append(f"no step finished for {stalled:.0f} s" + (" and every rank is in a collective" if in_collectives else ""))
    waits = "; ".join(f"{compact_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in {what}"
                      for what, ranks in waiting.items())
    return (f"hang: {'; '.join(parts)}" + (f"; {waits}" if waits else "") +
            f"; dumps in {dumps}; exit code {HANG_EXIT}: torchrun --max-restarts restarts from the newest snapshot")


def announce(line: str) -> None:
    """The line on stdout and in torchrun's error file (its failure summary shows it)."""
    print(line, flush=True)
    write_error_file(line)


class HangWatchdog:
    """One per rank (see the module doc). `timeout_s` 0: off (every method is then free)."""

    def __init__(self, timeout_s: float, rank: int, world_size: int, local_rank: int, distributed: bool,
                 run_dir: Path):
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.local_rank, self.distributed, self.run_dir = local_rank, distributed, run_dir
        self.host = socket.gethostname()
        # one process has no process group to time out: no limit
        self.limit_s = BUDGET_SHARE * pg_timeout().total_seconds() if distributed else float("inf")
        if timeout_s > self.limit_s and rank == 0:
            print(f"warning: trainer.hang_timeout_s={timeout_s:g} is above {BUDGET_SHARE:g} x the process-group "
                  f"timeout ({pg_timeout().total_seconds():g} s, MINGPT_PG_TIMEOUT), where a stuck collective "
                  f"ends the job without a line: the watchdog fires after {self.limit_s:g} s", file=sys.stderr, flush=True)
        self._beat = Beat(0, "first steps", time.monotonic())
        self._beats = 0  # steps finished since watching began
        self._slowest = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._trainer_thread = threading.get_ident()
        self._store = None

    def beat(self, step: int) -> None:
        """The step loop finished `step`: the one cost on an ordinary step."""
        now, last = time.monotonic(), self._beat
        if last.phase == "train":
            self._slowest = max(self._slowest, now - last.at)
        self._beats += 1
        self._beat = Beat(step, "first steps" if self._beats < FIRST_STEPS else "train", now)

    @contextmanager
    def phase(self, name: str):
        """A longer budget for `name` (evaluation, a snapshot save); the next step's clock starts after it."""
        step = self._beat.step
        self._beat = Beat(step, name, time.monotonic())
        try:
            yield
        finally:
            self._beat = Beat(step, "train", time.monotonic())

    @contextmanager
    def watching(self, step: int):
        """Watch what runs inside this block: the launch's start-up (resume, the first files), then
        the step loop from `step` on; start-up and the first steps get the long budget."""
        if not self.timeout_s:
            yield
            return
        self._beats, self._trainer_thread = 0, threading.get_ident()
        self._beat = Beat(step, "start-up", time.monotonic())
        if self.distributed:
            self._store = self._connect()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()

    def _connect(self):
        """The store connection, and this rank's identity in it (named in the line if it stops)."""
        try:
            store = side_store("hang", STORE_TIMEOUT_S)
            store.set(f"who/{self.rank}", f"{self.host} {self.local_rank}")
            return store
        except (RuntimeError, OSError) as e:
            print(f"warning: the hang watchdog cannot reach the rendezvous store ({e}); a hang will be "
                  f"reported by each rank for itself", file=sys.stderr, flush=True)
            return None

    def budget(self, beat: Beat) -> float:
        """Seconds without a step before the watchdog fires; under torchrun never past BUDGET_SHARE of
        the process group's timeout, so that it fires (and names the stuck rank) before a collective
        times out: on NCCL that timeout aborts every rank with no line. A phase that may take longer
        on every rank (a first compile, a save of a large model) needs a larger MINGPT_PG_TIMEOUT."""
        factor = 1 if beat.phase == "train" else LONG_PHASE_FACTOR
        return min(max(factor * self.timeout_s, SLOW_STEP_FACTOR * self._slowest), self.limit_s)

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            beat = self._beat
            stalled = time.monotonic() - beat.at
            if stalled > self.budget(beat):
                self._fire(beat, stalled)
                return

    def _fire(self, beat: Beat, stalled: float) -> None:
        dumps = self.run_dir / "hang" / f"attempt{restart_count()}"
        frame = sys._current_frames().get(self._trainer_thread)
        waits_in, last_seq = collective_state(flight_records())
        report = RankReport(self.rank, self.host, self.local_rank, beat.step, beat.phase, round(stalled, 1),
                            project_frame(frame) if frame is not None else "?", waits_in, last_seq)
        self._write_dumps(dumps)
        try:
            self._agree(report, dumps)
        except (RuntimeError, OSError) as e:  # the store does not answer: say what this rank knows
            announce(hang_line({self.rank: report}, 1, {}, dumps) +
                     f" (rank {self.rank} alone: the rendezvous store does not answer: {e})")
        sys.stderr.flush()
        os._exit(HANG_EXIT)

    def _write_dumps(self, dumps: Path) -> None:
        try:
            dumps.mkdir(parents=True, exist_ok=True)
            stacks = "\n".join(f"--- thread {ident}{' (training)' if ident == self._trainer_thread else ''}\n"
                               + "".join(traceback.format_stack(f)) for ident, f in sys._current_frames().items())
            (dumps / f"stacks_rank_{self.rank}.txt").write_text(stacks, encoding="utf-8")
            for name, prefix in (("_dump_fr_trace", "fr_trace_rank_"), ("_dump_nccl_trace", "nccl_trace_rank_")):
                dump = _recorder_dump(name, True, True, False)  # (collectives, stack traces, only active)
                if dump:
                    (dumps / f"{prefix}{self.rank}").write_bytes(dump)
        except (OSError, RuntimeError) as e:  # a full or hung disk must not keep the line from being printed
            print(f"warning: hang dumps not written to {dumps}: {e}", file=sys.stderr, flush=True)

    def _agree(self, report: RankReport, dumps: Path) -> None:
        """Publish this rank's report; the first rank to claim the line gathers the others' and
        announces it; the other ranks wait until it has (their exit makes torchrun stop the group)."""
        store = self._store
        if store is None:
            announce(hang_line({self.rank: report}, 1, {}, dumps))
            return
        store.set(f"report/{self.rank}", report.to_json())
        store.add("reports", 1)
        if store.compare_set("reporter", "", str(self.rank)).decode() != str(self.rank):
            store.wait(["line"], datetime.timedelta(seconds=gather_seconds(self.timeout_s) + 30))
            write_error_file(store.get("line").decode())  # whichever rank torchrun sees first shows the line
            return
        deadline = time.monotonic() + gather_seconds(self.timeout_s)
        while store.add("reports", 0) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
        reports, identities = {}, {}
        for r in range(self.world_size):
            if store.check([f"report/{r}"]):
                reports[r] = RankReport.from_json(store.get(f"report/{r}"))
            elif store.check([f"who/{r}"]):
                host, local = store.get(f"who/{r}").decode().rsplit(" ", 1)
                identities[r] = (host, int(local))
        line = hang_line(reports, self.world_size, identities, dumps)
        announce(line)
        store.set("line", line)
