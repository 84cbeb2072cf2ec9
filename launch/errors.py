"""How a launch ends when it refuses: one line, an exit code, and torchrun's error file.

Bad input anywhere is a `UsageError` (config.py): one line on stderr (rank 0's), exit 2. A
non-finite loss or weight is a `NonFiniteError` (guards/health.py): one line, exit 1. A snapshot
the storage refused (full, read-only, no permission, an I/O error) is a `StorageError`
(storage/failures.py): one line naming the snapshot that stays the resume point, exit 3. Any other
exception is a bug and keeps its traceback. Under torchrun the same line goes to the worker's
TORCHELASTIC_ERROR_FILE, the file torchrun's failure summary shows.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import traceback
import typing
import warnings

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from config import Config, UsageError
from guards.health import NonFiniteError
from guards.replicas import ReplicaMismatch
from parallel.env import write_error_file
from storage.failures import STORAGE_EXIT, StorageError

# How long a rank other than 0 waits before reporting an error under torchrun, so rank 0 (which
# meets the same bad input) reports it first and the agent stops the rest (it polls every 0.1 s).
# 3 s was measured too short on a loaded 2-core machine (rank 0 reached the error later and the
# summary named rank 1); the wait costs only a launch where rank 0 alone is fine.
RANK0_FIRST_S = 10.0


def one_line_warnings() -> None:
    """Warnings print as 'warning: message', without the file and source line."""
    def fmt(message, category, filename, lineno, line=None):
        return f"warning: {message}\n"
    warnings.formatwarning = fmt


def exit_code(e: BaseException) -> int:
    if isinstance(e, StorageError):
        return STORAGE_EXIT
    return 2 if isinstance(e, UsageError) else 1


def error_line(e: BaseException) -> str | None:
    """The one line a refused launch ends with: bad input (UsageError), a storage failure or a
    non-finite loss; None for any other exception (a bug: its traceback is the useful report)."""
    if isinstance(e, (UsageError, StorageError)):
        return f"error: {e}"
    if isinstance(e, ReplicaMismatch):
        kept = (f"the newest snapshot {e.last_snapshot} stays the resume point" if e.last_snapshot
                else "no snapshot was written, so a relaunch starts from step 0")
        return (f"error: training stopped: {e.what}; nothing of this step was saved and {kept}; a copy changed "
                f"without an update (a flipped bit in memory or on the wire): check that host (ECC errors, "
                f"dmesg) and relaunch")
    if isinstance(e, NonFiniteError):
        kept = (f"the newest snapshot {e.last_snapshot} stays the resume point" if e.last_snapshot
                else "no snapshot was written, so a relaunch starts from step 0")
        return (f"error: training stopped: {e.what}; nothing after it was saved and {kept}; lower "
                f"optimizer.lr or trainer.grad_clip (or use trainer.precision=fp32) and relaunch")
    return None


class OneLineErrors(ErrorHandler):
    """What `record` writes to this worker's TORCHELASTIC_ERROR_FILE, the file torchrun's failure
    summary shows (its py_callstack; without a file: "To enable traceback see ..."). For our one-line
    errors it holds that line instead of a traceback; other exceptions keep torch's record (the
    exception and its traceback). Either is written whole or not at all: torchrun's agent crashes on
    a half-written file (a worker killed while writing it) instead of restarting the group.

    Every rank meets the same bad input at about the same time, and torchrun's summary names the
    failure with the earliest error-file timestamp as root cause and lists every other failed rank
    with its own message. So a rank other than 0 waits before writing: when rank 0 refused too, the
    agent stops this rank during the wait (SIGTERM), and the line appears once in the summary (rank
    0's) and once on stderr (only rank 0 prints it); when only this rank refused, the summary shows
    its line after the wait."""

    def initialize(self) -> None:  # faulthandler: only in a torchrun worker, not in a caller's process
        if self._get_error_file_path():
            super().initialize()

    def record_exception(self, e: BaseException) -> None:
        line, path = error_line(e), self._get_error_file_path()
        if not path:  # not a torchrun worker: nothing reads an error file
            return None
        if line is None:  # a bug: torch's record (the exception and its traceback), written whole
            return write_error_file(f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e)))
        if int(os.environ.get("RANK", "0")) != 0:
            time.sleep(RANK0_FIRST_S)
        write_error_file(line)


def reject_dashed_overrides(argv: list[str]) -> None:
    """`--trainer.max_steps=20` (the option style of many other trainers) is not an option here:
    say how overrides are written instead of argparse's bare "unrecognized arguments"."""
    sections = {f.name for f in dataclasses.fields(Config)}
    for i, arg in enumerate(argv):
        if arg == "--":
            return
        name, eq, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and "." in name and name.split(".", 1)[0] in sections:
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                value = argv[i + 1]  # `--trainer.max_steps 20`
            raise UsageError(f"'{arg}' is not an option: config overrides are written without leading "
                             f"dashes, as {name}={value or '<value>'}")


def bare_key_hint(unknown: list[str], argv: list[str]) -> str | None:
    """`--max_steps=20` (nanoGPT's configurator style: a key without its section) among the
    arguments argparse did not recognise: the line naming the override it stands for, or None."""
    keys, sections = {}, typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        for field in dataclasses.fields(sections[section.name]):
            keys.setdefault(field.name, []).append(f"{section.name}.{field.name}")
    for arg in unknown:
        name, eq, value = arg.lstrip("-").partition("=")
        dotted = keys.get(name.replace("-", "_"))
        if not arg.startswith("-") or not dotted:
            continue
        if not eq and arg in argv and argv.index(arg) + 1 < len(argv):
            value = argv[argv.index(arg) + 1]  # `--max_steps 20`
        spelled = " or ".join(f"{key}={value or '<value>'}" for key in dotted)
        return (f"'{arg}' is not an option: config overrides are written section.key=value, without "
                f"dashes, as {spelled}")
    return None


def quiet_broken_pipe(command) -> int:
    """command()'s exit code; when the reader of stdout went away (`python main.py ... | head -1`),
    no traceback and the exit code of a process that SIGPIPE ended, 128 + 13, as the shell reports
    `yes | head -1`'s. stdout is pointed at /dev/null so that Python's flush at exit does not fail
    again (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        return command()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
