"""What a launch stopped by SIGTERM or SIGINT (Ctrl-C, preemption) prints: one closing line per job
that names what was saved and the exact command that resumes.

During training only the signal is recorded (`StopRequest`): every rank stops after one
agreed step and saves it. Outside the step loop (start-up, the outputs after training) there is no
step to agree on, so the first signal raises `Interrupted` at once, as Python's KeyboardInterrupt
would, and main.py turns it into one line instead of a traceback from every rank.

This module imports nothing heavy: main.py installs its handlers before torch loads."""
from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what SLURM, Kubernetes, torchrun and a terminal send before a kill
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


# The launch's training, once its step loop began (launch/app.py run): () -> (step, newest
# snapshot). A stop signal that arrives after an error left the loop, while the launch unwinds,
# is reported with it (main.py) instead of as a start-up.
_training: Callable[[], tuple[int, object]] | None = None
# main()'s launch returned (finished, stopped with its own line, or had nothing left to do): a stop
# signal while the process then ends has nothing to add.
_returned = False


def training_began(progress: Callable[[], tuple[int, object]] | None) -> None:
    """`progress` once the step loop begins; None as a launch starts (a caller may run several
    launches in one process), which also forgets that an earlier one returned."""
    global _training, _returned
    _training = progress
    _returned = False


def launch_returned() -> None:
    global _returned
    _returned = True


def training_progress() -> tuple[int, object] | None:
    return _training() if _training is not None else None


class Interrupted(BaseException):
    """A stop signal outside the step loop. A BaseException like KeyboardInterrupt, so the
    `except Exception` of torchelastic's `record` and of the after-training outputs let it pass."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.reported = False  # its closing line is printed


def raise_interrupted(signum, frame) -> None:
    """The handler outside the step loop. Later signals are ignored while the launch winds down:
    a terminal's Ctrl-C reaches a torchrun worker twice (from the terminal, then forwarded by the
    agent), and the second must not interrupt the first one's closing line."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def stop_while_loading(signum, frame) -> None:
    """The handler main.py installs before it imports torch (seconds), when nothing of the run
    exists yet, and again once main() has returned, while the process ends: the one line (rank 0),
    then end by the signal. After main() it is no start-up: a launch whose step loop began and
    then failed (a peer killed mid-save: this rank's collective fails, its error unwinds, and
    torchrun's SIGTERM arrives) is named by its step and newest snapshot; a launch that returned
    has printed its own last line. It writes with os.write, since the interrupted code may be
    inside a print of its own (a buffered write is not reentrant)."""
    for sig in STOP_SIGNALS:  # as in raise_interrupted: the agent's forwarded copy must not print twice
        signal.signal(sig, signal.SIG_IGN)
    if int(os.environ.get("RANK", "0")) == 0 and not _returned:
        line = interrupted_line(signum, launch_command(resume_never=False), training=training_progress())
        os.write(1, (line + "\n").encode())
    die_by(signum, flush=False)


def die_by(signum: int, flush: bool = True) -> None:
    """End this process by `signum` itself, as an unhandled SIGTERM would (and as CPython ends a
    process after an uncaught KeyboardInterrupt): a shell sees 128 + signum, and torchrun's failure
    summary says "Signal 15 (SIGTERM) received by PID ..." for a worker it stopped, instead of "To
    enable traceback see ..." for an exit code it has no error file for."""
    if flush:
        sys.stdout.flush()
        sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def launch_command(resume_never: bool) -> str | None:
    """The command line that launched this job, to relaunch it: torchrun's own (read from its
    agent, this worker's parent; RANK and WORLD_SIZE are set as parallel/env.py checks) or this
    process's. A job that started with trainer.resume=never gets trainer.resume=auto appended
    (later overrides win), or it would refuse its own snapshots. None where the command cannot be
    known (not Linux, or another launcher)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        try:
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        except OSError:
            return None
        argv = torchrun_command([a.decode(errors="replace") for a in raw.split(b"\0")[:-1]])
    else:
        argv = list(sys.orig_argv)
    if argv is None:
        return None
    return shlex.join(argv + (["trainer.resume=auto"] if resume_never else []))


def torchrun_command(cmdline: list[str]) -> list[str] | None:
    """The command a user typed, from a torchrun agent's /proc cmdline: `python -m torch.distributed.run
    ...` as it is; the `torchrun` script runs as `<interpreter> <path>/torchrun ...` (its shebang), shown
    as `torchrun ...`. None for any other parent."""
    for i in range(len(cmdline) - 1):
        if cmdline[i] == "-m":
            return cmdline if cmdline[i + 1] in TORCHRUN_MODULES else None
        if Path(cmdline[i]).name == "torchrun":
            return ["torchrun", *cmdline[i + 1:]]
    return None


def stop_line(signum: int, step: int, snapshot: str, command: str | None) -> str:
    """The closing line of a run stopped during training, after its stop snapshot."""
    how = f"to resume: {command}" if command else "run the same command again to resume"
    return f"stopped by {signal.Signals(signum).name} at step {step}: saved {snapshot}; {how}"


def interrupted_line(signum: int, command: str | None, final_snapshot: str | None = None,
                     run_dir: Path | None = None, training: tuple[int, Path | None] | None = None) -> str:
    """The closing line of a launch interrupted outside the step loop: during start-up (nothing of
    this launch is saved; the run folder is as a relaunch needs it), after training
    (`final_snapshot` is written; model.pt or sample.txt may be missing), or while training left
    the step loop by an error (`training`: the step it reached and the newest snapshot, which a
    relaunch resumes from)."""
    name = signal.Signals(signum).name
    if final_snapshot is not None:
        return (f"stopped by {name} after training: saved {final_snapshot}, but model.pt or sample.txt may "
                f"be missing; to write model.pt: python export.py --run-dir {shlex.quote(str(run_dir))}")
    if training is not None:
        step, newest = training
        how = f"to resume: {command}" if command else "run the same command again to resume"
        resumes = f"the newest snapshot is {newest}" if newest else "no snapshot yet"
        return f"stopped by {name} at step {step}, outside a step (after an error): {resumes}; {how}"
    how = f"to relaunch: {command}" if command else "run the same command again to relaunch"
    return f"stopped by {name} during start-up: this launch saved nothing; {how}"
