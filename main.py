"""Train a GPT with the parallel layout chosen in the config: `python main.py [--config F]
[section.key=value ...]`, or the same under torchrun.

Owns the order of start-up: config -> process group -> run folder lock -> corpus and tokenizer
-> model (same seed on every rank) -> strategy (parallel layout) -> Trainer -> resume -> writes
(tokenizer.json, tracker, config.yaml) -> start-up view -> train -> model.pt + sample. (With
trainer.run_dir at its default and a URL corpus, the corpus comes before the lock: the offline
fallback text trains into its own folder. A resume with nothing left to train ends after the
resume, writing nothing.) Bad input anywhere surfaces as `UsageError`: one line on stderr (rank
0's, the only thing printed; under torchrun also its failure summary, via the elastic error file)
and exit code 2. Nothing in the run folder is written before every check (resume's included) has
passed, so a refused launch leaves the folder as it was.
SIGTERM/SIGINT during training: every rank stops at one step, saves it, one line naming the
command that resumes, exit (launch/app.py); before or after training: one line, then the process
ends by that signal (launch/stopping.py). A non-finite loss or weight: one line, exit 1. A
snapshot the storage refuses (full, read-only, no permission, I/O error): one line naming the
snapshot that stays the resume point, exit 3 (storage/failures.py).

This file is the command: its arguments, and the one place errors and signals end a launch
(launch/errors.py). The launch itself is launch/app.py, building the Trainer launch/build.py.
`--plan` predicts a layout's costs (planner/__init__.py); `--dry-run` runs its real code on simulated
ranks beside that prediction (tools/dry_run.py: exit 1 on a disagreement).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from launch.stopping import (
    STOP_SIGNALS,
    Interrupted,
    die_by,
    interrupted_line,
    launch_command,
    launch_returned,
    raise_interrupted,
    stop_while_loading,
    training_began,
    training_progress,
)

# Kineto (torch.profiler's engine, trainer.profile) prints `USDT: ... profiler_start` and `profiler_stop`
# on stderr: level USDT (5) is its highest, so only 6 silences it (kineto/ILoggerObserver.h), its errors
# (4) too. Read once, when torch loads; KINETO_LOG_LEVEL=4 in the environment shows the errors again.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

if __name__ == "__main__":  # torch loads for seconds: a Ctrl-C meanwhile is one line, not a traceback
    for _sig in STOP_SIGNALS:
        signal.signal(_sig, stop_while_loading)

from torch.distributed.elastic.multiprocessing.errors import record

from checks import load_config
from config import DEFAULT_CONFIG, UsageError
from launch.app import adopt_unset_keys, run
from launch.errors import (
    OneLineErrors,
    bare_key_hint,
    error_line,
    exit_code,
    one_line_warnings,
    quiet_broken_pipe,
    reject_dashed_overrides,
)
from observe.host_memory import return_large_frees
from planner import (
    default_reserve,
    fit_advice,
    host_memory_note,
    load_hardware,
    parse_bytes,
    plan,
    refuse_unpriced,
    render,
)
from tools.calibrate import measure_local
from tools.dry_run import dry_run_command


def parse_args(argv):
    reject_dashed_overrides(argv)
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Overrides: section.key=value, e.g. trainer.max_steps=200 parallel.strategy=fsdp")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    ap.add_argument("--print-config", action="store_true",
                    help="print the whole resolved config at start-up (it is always written to <run_dir>/config.yaml)")
    plan = ap.add_argument_group("plan a layout (no processes are launched)")
    plan.add_argument("--plan", action="store_true",
                      help="print the predicted per-rank memory and bytes moved of this config's layout and of "
                           "every other layout on --world-size ranks, then exit")
    plan.add_argument("--dry-run", action="store_true",
                      help="run this config's layout on --world-size simulated ranks in this process (fake "
                           "process group, fake tensors), one optimizer step per distinct rank role, and compare "
                           "it with --plan's prediction: exit 1 on a disagreement above 1%%")
    plan.add_argument("--world-size", type=int, default=None,
                      help="ranks to plan for (default: WORLD_SIZE under torchrun, else 1)")
    plan.add_argument("--device-memory", default=None,
                      help="flag layouts whose peak exceeds this, e.g. 80GB, 80G (10^9 bytes) or 80GiB (2^30)")
    plan.add_argument("--reserve-memory", default=None, metavar="SIZE",
                      help="device memory kept for the runtime (CUDA context, NCCL, allocator): a layout fits in "
                           "--device-memory minus this (default: a tenth of it, at most 3GB)")
    plan.add_argument("--hardware", default=None, metavar="NAME|FILE",
                      help="predict step times for this hardware: local (this machine, measured once), "
                           "a100-80gb, h100-sxm, h200-sxm (planner/hardware/*.yaml) or a YAML file (default: local)")
    plan.add_argument("--plan-json", default=None, metavar="PATH", help="also write the plan as JSON to PATH")
    plan.add_argument("--explain", action="store_true", help="with --plan: every formula and its source")
    ap.add_argument("overrides", nargs="*", help="dotted overrides section.key=value")
    args, unknown = ap.parse_known_args(argv)
    if unknown:
        hint = bare_key_hint(unknown, list(argv))
        if hint:
            raise UsageError(hint)
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def print_plan(args) -> int:
    """--plan: predictions for every layout on --world-size ranks (planner/__init__.py); no process group."""
    cfg = load_config(args.config, args.overrides, adopt=adopt_unset_keys)
    refuse_unpriced(cfg, "--plan")
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    if args.reserve_memory is not None and memory is None:
        raise UsageError("--reserve-memory applies with --device-memory; add --device-memory, e.g. 80GB")
    reserve = default_reserve(memory) if args.reserve_memory is None else parse_bytes(args.reserve_memory, "--reserve-memory")
    if memory is not None and reserve >= memory:
        raise UsageError(f"--reserve-memory {args.reserve_memory} leaves nothing of --device-memory {args.device_memory}; "
                         f"reserve less")
    hardware = load_hardware(args.hardware or "local", cfg.trainer.precision, measure=measure_local)
    result = plan(cfg, world, memory, hardware, reserve)
    if memory is not None and result.layouts and not any(lp.fits for lp in result.layouts):
        result.advice = fit_advice(cfg, world, memory, hardware, reserve)
    if args.plan_json:
        try:
            Path(args.plan_json).write_text(result.to_json(), encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--plan-json '{args.plan_json}' cannot be written ({e.strerror}); "
                             f"give a path in a writable folder") from None
    print(render(result, explain=args.explain), flush=True)
    if note := host_memory_note(cfg.trainer.host_memory, hardware.name):
        print(note, flush=True)
    return 0


def run_dry(args) -> int:
    """--dry-run: the real code of every rank role of --world-size ranks, beside the plan (tools/dry_run.py)."""
    cfg = load_config(args.config, args.overrides, adopt=adopt_unset_keys)
    refuse_unpriced(cfg, "--dry-run")
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    return dry_run_command(cfg, world, args.plan_json)


def launch(argv, keep_process_group: bool = False) -> int:
    """One command line: --plan, --dry-run, or one launch of the training app."""
    args = parse_args(argv)
    if args.dry_run:
        return run_dry(args)
    return print_plan(args) if args.plan else run(args, keep_process_group)


def main(argv=None, keep_process_group: bool = False) -> int:
    """`keep_process_group`: leave the process group up at the end, for a caller that runs several
    launches in one torchrun job (the tests' workers)."""
    one_line_warnings()
    return_large_frees()  # freed tensors go back to the kernel: each rank's memory is what it holds
    training_began(None)  # nothing of an earlier launch in this process is reported as this one's
    # From here on a stop signal is one line, never a traceback (launch/app.py records it instead)
    previous = {sig: signal.signal(sig, raise_interrupted) for sig in STOP_SIGNALS} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        code = record(launch, error_handler=OneLineErrors())(sys.argv[1:] if argv is None else argv,
                                                              keep_process_group)
        launch_returned()  # a signal from here on ends the process without a line (stop_while_loading)
        return 0 if code is None else code  # record() turns argparse's SystemExit(0) (--help) into None
    except Interrupted as e:  # launch/app.py reports it once the config exists; before that, here
        if int(os.environ.get("RANK", "0")) == 0 and not e.reported:
            print(interrupted_line(e.signum, launch_command(resume_never=False), training=training_progress()),
                  flush=True)
        die_by(e.signum)
        return 128 + e.signum  # only if the signal did not end the process
    except Exception as e:
        for sig in previous:  # a stop signal now, as the error is reported, is one line too (not a traceback)
            signal.signal(sig, stop_while_loading)
        line = error_line(e)
        if line is None:
            raise
        if int(os.environ.get("RANK", "0")) == 0:  # one line per job: every rank meets the same input
            print(line, file=sys.stderr, flush=True)
        return exit_code(e)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(quiet_broken_pipe(main))
