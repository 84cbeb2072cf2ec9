"""One launch of the training app, in the order main.py's doc gives: checks, the run folder, the
Trainer, the start-up view, training, the outputs.

`run` is what `python main.py` and every torchrun worker execute after parsing the command line.
Nothing in the run folder is written before every check (resume's included) has passed, so a
refused launch leaves the folder as it was. A stop signal during training stops every rank at one
agreed step, saved (`train_until_stopped`, `stop_exit_code`); outside the step loop it is one line
(launch/stopping.py).
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import warnings
from pathlib import Path

import torch.distributed as dist

from checks import load_config
from config import Config, UsageError, dump_yaml, redact_url
from corpus.token_files import adopt_corpus_tokenizer
from corpus.tokenizers import TOKENIZER_FILE, save_tokenizer
from launch.build import build_parts, fallback_corpus
from launch.runlock import lock_run_dir
from launch.sampling import SAMPLE_FILE, write_sample
from launch.schedule import schedule_change, schedule_notes
from launch.stopping import (
    STOP_SIGNALS,
    Interrupted,
    interrupted_line,
    launch_command,
    stop_line,
    training_began,
    training_progress,
)
from observe.host_memory import reuse_step_memory
from observe.profiling import profile_note
from observe.step_metrics import RunSummary
from parallel.env import DistEnv, cpu_devices, init_distributed, local_world_size, shutdown
from parallel.precision import resolve_precision
from planner.auto import choose_layout
from snapshots.resume import nothing_left_message
from storage.failures import StorageError, os_error_in
from storage.files import atomic_write_text
from trainer import Trainer
from weights.model_file import MODEL_FILE, InOrder, model_layout, read_model_file
from weights.pretrained import adopt_model_shape
from weights.tensor_files import storage_order

PLAN_ONLY_FLAGS = "--world-size, --device-memory, --reserve-memory, --hardware, --plan-json and --explain"


def adopt_unset_keys(cfg: Config, explicit: set[str]) -> None:
    """load_config's `adopt` for every command: the keys the user did not set take the values of
    what names them (model.size or model.init_from: the shape; a token corpus: the tokenizer)."""
    adopt_model_shape(cfg, explicit)
    adopt_corpus_tokenizer(cfg, explicit)


def run(args: argparse.Namespace, keep_process_group: bool = False) -> int:
    """One launch. `keep_process_group`: leave the process group up at the end, for a caller that
    runs several launches in one torchrun job (the tests' workers)."""
    cfg = load_config(args.config, args.overrides, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                      adopt=adopt_unset_keys)
    if any(v is not None for v in (args.world_size, args.device_memory, args.reserve_memory, args.hardware)) \
            or args.plan_json or args.explain:
        raise UsageError(f"{PLAN_ONLY_FLAGS} only apply with --plan; add --plan")
    device_set_by_override = any(o.partition("=")[0].strip() == "trainer.device" for o in args.overrides)
    env = init_distributed(cfg, config_file=None if device_set_by_override else args.config)
    cfg, precision_line = resolve_precision(cfg, env.device)  # trainer.precision=auto: before anything is built
    auto_lines: list[str] = [precision_line] if precision_line else []
    if cfg.parallel.strategy == "auto":  # the planner picks the layout: before anything is built
        cfg, layout_lines = choose_layout(cfg, env)
        auto_lines += layout_lines
    lock, trainer, summary = None, None, None
    training_began(None)  # a caller may run several launches in one process (the tests' workers)
    try:
        corpus = fallback_corpus(cfg, env)  # may move run_dir: before the lock
        run_dir = Path(cfg.trainer.run_dir).expanduser()
        lock = lock_run_dir(run_dir, env.rank, env.distributed)  # before anything reads the folder
        parts = build_parts(cfg, env, run_dir, corpus=corpus)
        trainer = Trainer(parts)
        with parts.guards.watchdog.watching(trainer.step):  # hangs from here to the last step (guards/watchdog.py)
            go_on, schedule_note = _resume(trainer, cfg, env, run_dir)
            if not go_on:
                return 0
            _start(args, cfg, env, trainer, run_dir, auto_lines + ([schedule_note] if schedule_note else []))
            # the committed resume point: under trainer.async_save, last_snapshot may be a save in flight
            training_began(lambda: (trainer.step, trainer.snapshots.newest))
            with reuse_step_memory(cfg.trainer.host_memory == "reuse"):  # built and loaded lean either way
                summary = train_until_stopped(trainer)
        if summary.stopped:
            trainer.close_tracker()
            if trainer.strategy.is_tracker:
                print(stop_line(summary.stopped, summary.final_step, summary.snapshot,
                                launch_command(cfg.trainer.resume == "never")), flush=True)
            return stop_exit_code(summary.stopped, env.distributed)
        _finish(cfg, env, trainer, summary, run_dir)
    except Interrupted as e:  # a signal outside the step loop (launch/stopping.py); main() ends the process
        if env.rank == 0:  # one line per job: every rank got the same signal
            final = str(trainer.last_snapshot) if summary is not None else None
            # this launch saved nothing (or finished): its own command, trainer.resume as it was
            print(interrupted_line(e.signum, launch_command(resume_never=False), final,
                                   Path(cfg.trainer.run_dir).expanduser(),
                                   training_progress() if final is None else None), flush=True)
        e.reported = True
        raise
    finally:
        if trainer is not None:  # a background save still writing: not after the folder is released
            trainer.snapshots.drain()
        if lock is not None:
            lock.release()
        if not keep_process_group:
            shutdown()
    return 0


def _resume(trainer: Trainer, cfg: Config, env: DistEnv, run_dir: Path) -> tuple[bool, str | None]:
    """Resume from the snapshot the builder chose (launch/build.py start_from). Returns (go on,
    the note of a resume whose LR schedule changed, or None). Not going on: a finished run was
    relaunched, which has nothing to do (one line says so; no eval, export, sample or tracker run
    would be new)."""
    meta = trainer.resume()
    note, decay = schedule_change(cfg, trainer.data, meta, trainer.step, trainer.max_steps) \
        if meta is not None else (None, None)
    if meta is not None and trainer.step >= trainer.max_steps:
        if env.rank == 0:
            decay = decay or cfg.optimizer.lr_decay_steps or trainer.max_steps
            print(nothing_left_message(cfg, run_dir, trainer.step, trainer.max_steps, decay), flush=True)
        return False, None
    trainer.snapshots.check_room()  # a disk still full: stop now, not at the next save
    return True, note


def _start(args: argparse.Namespace, cfg: Config, env: DistEnv, trainer: Trainer, run_dir: Path,
           notes: list[str]) -> None:
    """Every check has passed: from here on this launch writes into the run folder. `notes`:
    what parallel.strategy=auto chose (and the runner-up), and how a resume changed the LR
    schedule, printed after the start-up view."""
    write_start_files(trainer, cfg, env, run_dir)
    trainer.open_tracker()  # on the one rank that holds the reduced loss
    if env.rank == 0:
        if args.print_config:
            print(dump_yaml(cfg), end="", flush=True)
        print(startup_view(args, cfg, env, trainer), flush=True)
        for line in notes:
            print(line, flush=True)
        if trainer.rng_note:  # a resume that restarts dropout's random streams
            print(trainer.rng_note, flush=True)
        for note in schedule_notes(cfg, trainer.max_steps):
            print(note, flush=True)
        if note := profile_note(cfg.trainer.profile, trainer.step, trainer.max_steps):
            print(note, flush=True)
        if env.device.type == "cpu" and (crowded := cpu_devices(env.world_size, local_world_size(env.world_size))[1]):
            warnings.warn(crowded, stacklevel=1)


def write_start_files(trainer: Trainer, cfg: Config, env: DistEnv, run_dir: Path) -> None:
    """Collective. Rank 0 writes tokenizer.json and config.yaml (each whole or not at all); a write
    the storage refuses (a disk full before the first snapshot) stops every rank with the storage
    line and exit 3, as a refused snapshot does."""
    refused = None
    if env.rank == 0:
        try:
            save_tokenizer(trainer.tokenizer, run_dir / TOKENIZER_FILE)
            atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
        except OSError as e:
            refused = e
    if env.distributed:
        box = [refused]
        dist.broadcast_object_list(box, src=0)
        refused = box[0]
    if refused is not None:
        raise StorageError("the run's first files (tokenizer.json, config.yaml)", run_dir, refused, trainer.last_snapshot)


def startup_view(args: argparse.Namespace, cfg: Config, env: DistEnv, trainer: Trainer) -> str:
    """The few lines a launch prints before training (the whole config: --print-config and
    <run_dir>/config.yaml). Printed only once every check has passed, so bad input shows only
    its one error line."""
    parts, t = trainer.parts, cfg.trainer
    strategy, data, tok = parts.strategy, parts.data, parts.tokenizer
    start = (f"resumed from {trainer.resumed_from} at step {trainer.step}" if trainer.resumed_from else "from step 0") + \
        (f", weights from {parts.init_from}" if parts.init_from else "")
    return (f"config: {args.config} + {redact_url(' '.join(args.overrides)) or 'no overrides'} "
            f"(resolved in {Path(t.run_dir).expanduser() / 'config.yaml'}; --print-config shows it)\n"
            f"layout: world {env.world_size} = {strategy.describe()} | device {env.device}\n"
            f"model: {parts.model_cost.num_params:,} parameters | data: {parts.data_source} | "
            f"{data.train.numel():,} train / {data.val.numel():,} val tokens | vocab {tok.vocab_size} ({tok.kind})\n"
            f"run: {trainer.max_steps} steps of {t.batch_size} x {cfg.model.block_size} = "
            f"{t.batch_size * cfg.model.block_size:,} tokens | {start} | mfu peak {parts.peak_label}")


def train_until_stopped(trainer: Trainer) -> RunSummary:
    """trainer.train() with SIGTERM and SIGINT recorded instead of killing the process, so a
    preempted job stops at a step boundary with a snapshot (see Trainer.train). The default
    handlers come back afterwards: export and sample run after the final snapshot, so a signal
    there loses nothing. Once a signal was recorded, later ones are ignored until the launch ends:
    a Ctrl-C reaches a torchrun worker twice (the terminal's, the agent's), and the stop prints one
    line."""
    if threading.current_thread() is not threading.main_thread():  # Python allows handlers only there
        return trainer.train()
    request = trainer.guards.stop_request
    previous = {sig: signal.signal(sig, request) for sig in STOP_SIGNALS}
    try:
        return trainer.train()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if request.signum else handler)


def stop_exit_code(signum: int, under_torchrun: bool) -> int:
    """Exit code of a run stopped by a signal after saving. Under torchrun 0: the agent restarts
    workers that exit non-zero (--max-restarts), which would undo a stop; when the agent itself
    got the signal it exits non-zero on its own. A single process exits 128 + signal number,
    as a shell reports a process ended by that signal, so `python main.py && next` stops."""
    return 0 if under_torchrun else 128 + signum


def _finish(cfg: Config, env: DistEnv, trainer: Trainer, summary: RunSummary, run_dir: Path) -> None:
    """The outputs: consolidated weights, a short sample, the tracker's summary. The run is complete
    here (its final snapshot is written), so failures in rank 0's file writes are one warning,
    never an exit code. model.pt is written one tensor at a time while every rank gathers that
    tensor (a collective: Strategy.full_tensors), so no rank holds the whole model; every rank runs
    the gather to its end (`drain`), so a write that failed midway strands no rank in it. The
    sample is drawn from model.pt as written, memory-mapped."""
    strategy = trainer.strategy
    layout = model_layout(trainer.model_config)
    weights = InOrder({k: tuple(v.shape) for k, v in layout.items()},
                      strategy.full_tensors({k: layout[k] for k in storage_order(layout)}))
    if env.rank == 0:
        model_failed: list[Exception] = []

        def write_model():
            try:
                trainer.write_model(run_dir / MODEL_FILE, weights)
            except Exception as e:
                model_failed.append(e)
                raise

        def write_sample_from_model():
            if model_failed:  # the sample is drawn from model.pt: the same failure, one cause in the warning
                raise model_failed[0]
            _write_sample(trainer, run_dir)
        outputs = {MODEL_FILE: write_model}
        if cfg.trainer.sample_tokens:
            outputs[SAMPLE_FILE] = write_sample_from_model
        write_outputs(outputs, trainer.last_snapshot, run_dir)
    weights.drain()
    env.barrier()
    if strategy.is_tracker:
        sample_path = run_dir / SAMPLE_FILE
        sample = after_training("reading the sample", lambda: sample_path.read_text(encoding="utf-8")) \
            if sample_path.is_file() else None
        trainer.close_tracker(summary, sample)
        val = f"{summary.val_loss:.4f}" if summary.val_loss is not None else "not evaluated (trainer.eval_every=0)"
        print(f"done: step {summary.final_step} | val loss {val} | outputs in {run_dir}", flush=True)


def write_outputs(outputs: dict, final_snapshot: Path | None, run_dir: Path) -> None:
    """Write each output of a finished run (name -> writer; each writes whole or not at all). Those
    that fail are one warning together (a full disk fails them all), naming the final snapshot
    and the command that rebuilds model.pt from it."""
    failed = {}
    for name, write in outputs.items():
        try:
            write()
        except BrokenPipeError:  # stdout's reader went away (`| head`): main.py ends quietly, not a write failure
            raise
        except Exception as e:  # the run is complete: nothing here may turn it into a failed one
            failed[name] = e
    if not failed:
        return
    causes = "; ".join(dict.fromkeys(_cause(e) for e in failed.values()))
    rebuild = (f"its final snapshot {final_snapshot} holds the weights, and python export.py --run-dir "
               f"{run_dir} writes {MODEL_FILE} from it" if MODEL_FILE in failed else
               f"{run_dir / MODEL_FILE} is written (python sample.py --run-dir {run_dir} samples it)")
    warnings.warn(redact_url(f"{' and '.join(failed)} could not be written after training ({causes}); "
                             f"the run itself is complete: {rebuild}"), stacklevel=2)


def _cause(e: Exception) -> str:
    """'OSError: No space left on device': the error's type and its first line, without paths;
    for a storage error, the OSError behind it (torch.save wraps a failed write in a RuntimeError)."""
    os_error = os_error_in(e)
    if os_error is not None and os_error.strerror:
        return f"{type(os_error).__name__}: {os_error.strerror}"
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _write_sample(trainer: Trainer, run_dir: Path) -> None:
    model = read_model_file(run_dir / MODEL_FILE, mmap=True).build_model()  # the file's pages, not a copy
    write_sample(model, trainer.tokenizer, trainer.cfg.trainer.sample_tokens, trainer.cfg.trainer.seed, run_dir)


def after_training(what: str, fn):
    """fn() for an output of a finished run; a failure is one warning line and returns None."""
    try:
        return fn()
    except Exception as e:  # the run is complete: nothing here may turn it into a failed one
        warnings.warn(redact_url(f"{what} failed after training ({_cause(e)}); the run itself is complete"),
                      stacklevel=2)
        return None
