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
command that resumes, exit (`train_until_stopped`, `stop_exit_code`); before or after training: one
line, then the process ends by that signal (stopping.py). A non-finite loss or weight: one line, exit 1.
"""
from __future__ import annotations

import argparse
import dataclasses as dc
import json
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

from launch.stopping import (
    STOP_SIGNALS,
    Interrupted,
    die_by,
    interrupted_line,
    launch_command,
    raise_interrupted,
    stop_line,
    stop_while_loading,
)

if __name__ == "__main__":  # torch loads for seconds: a Ctrl-C meanwhile is one line, not a traceback
    for _sig in STOP_SIGNALS:
        signal.signal(_sig, stop_while_loading)

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from char_dataset import (
    FALLBACK_RUN_DIR,
    FALLBACK_SOURCE,
    CharDataset,
    TokenDataset,
    build_tokenizer,
    load_corpus,
    load_tokenizer_record,
    save_tokenizer,
)
from config import (
    TrainerConfig,
    UsageError,
    dump_yaml,
    load_config,
    redact_url,
    reject_dashed_overrides,
    token_corpus_kind,
)
from corpus.token_files import corpus_tokenizer, open_token_corpus
from launch.runlock import lock_run_dir
from model import GPT, GPTConfig
from parallel.env import init_distributed, shutdown
from parallel.registry import build_strategy
from sample import default_prompt, generate_text, model_from_state
from snapshots.pretrained import check_shape, check_tokenizer, load_initial, open_source
from snapshots.store import list_snapshots
from trainer import NonFiniteError, Trainer, seed_rng

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "gpt2_train_cfg.yaml"
# How long a rank other than 0 waits before reporting an error under torchrun, so rank 0 (which
# meets the same bad input) reports it first and the agent stops the rest (it polls every 0.1 s).
RANK0_FIRST_S = 3.0


def _one_line_warnings() -> None:
    def fmt(message, category, filename, lineno, line=None):
        return f"warning: {message}\n"
    warnings.formatwarning = fmt


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
    plan.add_argument("--world-size", type=int, default=None,
                      help="ranks to plan for (default: WORLD_SIZE under torchrun, else 1)")
    plan.add_argument("--device-memory", default=None, help="flag layouts whose peak exceeds this, e.g. 80GB")
    plan.add_argument("--plan-json", default=None, metavar="PATH", help="also write the plan as JSON to PATH")
    plan.add_argument("--explain", action="store_true", help="with --plan: every formula and its source")
    ap.add_argument("overrides", nargs="*", help="dotted overrides section.key=value")
    return ap.parse_args(argv)


def print_plan(args, cfg) -> int:
    """--plan: predictions for every layout on --world-size ranks (planner.py); no process group."""
    from config import UsageError
    from costs.planner import parse_bytes, plan, render
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    result = plan(cfg, world, memory)
    if args.plan_json:
        try:
            Path(args.plan_json).write_text(result.to_json(), encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--plan-json '{args.plan_json}' cannot be written ({e.strerror}); "
                             f"give a path in a writable folder") from None
    print(render(result, explain=args.explain), flush=True)
    return 0


def build_trainer(cfg, env, run_dir: Path, corpus: tuple[str, str] | None = None):
    """Corpus, tokenizer, model (same seed on every rank), strategy and Trainer for `cfg` on this
    launch. Shared by main() and the parity tests, so both build runs the same way. `corpus`:
    load_corpus's (text, description) when the caller has loaded it already."""
    strategy = build_strategy(cfg, env)  # layout errors before any work
    # ---- data: the local leader downloads, everyone reads the same text
    token_corpus = open_token_corpus(cfg.data.path, cfg.data.tokenizer, cfg.data.val_path) \
        if token_corpus_kind(cfg.data.path) else None  # pre-tokenized, read from disk (memmap)
    if token_corpus is None:
        text, data_source = corpus or load_corpus(cfg.data, is_local_leader=env.local_rank == 0, barrier=env.barrier)
    else:
        text, data_source = "", token_corpus.description
    stored = load_tokenizer_record(run_dir / "tokenizer.json") if cfg.trainer.resume != "never" else None
    # model.init_from only starts a run: with snapshots to resume from, their weights win.
    resuming = cfg.trainer.resume != "never" and bool(list_snapshots(run_dir / "snapshots"))
    source = open_source(cfg.model.init_from) if cfg.model.init_from and not resuming else None
    if source is not None:
        stored = check_tokenizer(source, cfg.data.tokenizer, stored)
    if token_corpus is None:
        tok = build_tokenizer(cfg.data.tokenizer, text, stored)
        data = CharDataset(tok.encode(text), cfg.model.block_size, cfg.data.val_fraction, cfg.trainer.seed)
    else:  # the ids on disk fix the tokenizer: a run folder's or init_from's must be the same
        tok = build_tokenizer(cfg.data.tokenizer, text, corpus_tokenizer(token_corpus, stored))
        data = TokenDataset(token_corpus.train, token_corpus.val, cfg.model.block_size, cfg.trainer.seed,
                            digest=token_corpus.digest)
    # ---- model: identical on every rank (same seed, or the same init_from file), then placed by the strategy
    torch.manual_seed(cfg.trainer.seed)
    gpt_cfg = GPTConfig(vocab_size=tok.vocab_size,
                        **{k: v for k, v in dc.asdict(cfg.model).items() if k != "init_from"})
    model = GPT(gpt_cfg)
    if source is not None:
        check_shape(source, gpt_cfg)
        load_initial(model, source)
    strategy.setup(model)
    seed_rng(cfg.trainer.seed, 0, strategy.dp_rank)  # dropout: per dp rank, shared by tp peers
    return Trainer(cfg, data, tok, strategy, run_dir, dc.asdict(gpt_cfg), data_source=data_source,
                   init_from=source.path if source is not None else None)


def startup_view(args, cfg, env, trainer) -> str:
    """The few lines a launch prints before training (the whole config: --print-config and
    <run_dir>/config.yaml). Printed only once every check has passed, so bad input shows only
    its one error line."""
    strategy, data, tok, t = trainer.strategy, trainer.data, trainer.tokenizer, cfg.trainer
    start = (f"resumed from {trainer.resumed_from} at step {trainer.step}" if trainer.resumed_from else "from step 0") + \
        (f", weights from {trainer.init_from}" if trainer.init_from else "")
    return (f"config: {args.config} + {redact_url(' '.join(args.overrides)) or 'no overrides'} "
            f"(resolved in {Path(t.run_dir).expanduser() / 'config.yaml'}; --print-config shows it)\n"
            f"layout: world {env.world_size} = {strategy.describe()} | device {env.device}\n"
            f"model: {strategy.num_params:,} parameters | data: {trainer.data_source} | "
            f"{data.train.numel():,} train / {data.val.numel():,} val tokens | vocab {tok.vocab_size} ({tok.kind})\n"
            f"run: {trainer.max_steps} steps of {t.batch_size} x {cfg.model.block_size} = "
            f"{t.batch_size * cfg.model.block_size:,} tokens | {start} | mfu peak {trainer.peak_label}")


def train_until_stopped(trainer) -> dict:
    """trainer.train() with SIGTERM and SIGINT recorded instead of killing the process, so a
    preempted job stops at a step boundary with a snapshot (see Trainer.train). The default
    handlers come back afterwards: export and sample run after the final snapshot, so a signal
    there loses nothing. Once a signal was recorded, later ones are ignored until the launch ends:
    a Ctrl-C reaches a torchrun worker twice (the terminal's, the agent's), and the stop prints one
    line."""
    if threading.current_thread() is not threading.main_thread():  # Python allows handlers only there
        return trainer.train()
    previous = {sig: signal.signal(sig, trainer.stop_request) for sig in STOP_SIGNALS}
    try:
        return trainer.train()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if trainer.stop_request.signum else handler)


def stop_exit_code(signum: int, under_torchrun: bool) -> int:
    """Exit code of a run stopped by a signal after saving. Under torchrun 0: the agent restarts
    workers that exit non-zero (--max-restarts), which would undo a stop; when the agent itself
    got the signal it exits non-zero on its own. A single process exits 128 + signal number,
    as a shell reports a process ended by that signal, so `python main.py && next` stops."""
    return 0 if under_torchrun else 128 + signum


def run(argv, keep_process_group: bool = False) -> int:
    """One launch (see the module doc). `keep_process_group`: leave the process group up at the
    end, for a caller that runs several launches in one torchrun job (the tests' workers)."""
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.plan:
        return print_plan(args, cfg)
    if args.world_size is not None or args.device_memory is not None or args.plan_json or args.explain:
        raise UsageError("--world-size, --device-memory, --plan-json and --explain only apply with --plan; add --plan")
    device_set_by_override = any(o.partition("=")[0].strip() == "trainer.device" for o in args.overrides)
    env = init_distributed(cfg, config_file=None if device_set_by_override else args.config)
    lock, summary = None, None
    try:
        corpus = _fallback_corpus_run_dir(cfg, env)  # may move run_dir: before the lock
        run_dir = Path(cfg.trainer.run_dir).expanduser()
        lock = lock_run_dir(run_dir, env.rank, env.distributed)  # before anything reads the folder
        trainer = build_trainer(cfg, env, run_dir, corpus=corpus)
        strategy, tok = trainer.strategy, trainer.tokenizer
        gpt_cfg = GPTConfig(**trainer.model_config)
        meta = trainer.resume()
        if meta is None and cfg.model.init_from and trainer.init_from is None:
            # build_trainer skipped init_from because the folder holds snapshots (a resume wins),
            # and the model is already split; none was valid, so rather than train from random
            # weights, say how to start over from init_from.
            raise UsageError(f"{run_dir / 'snapshots'} holds no valid snapshot to resume; move that folder "
                             f"aside to start over from model.init_from")
        if meta is not None and trainer.step >= trainer.max_steps:
            # a finished run relaunched: no eval, export, sample or tracker run would be new
            if env.rank == 0:
                print(trainer.nothing_left_message(), flush=True)
            return 0

        # ---- every check has passed: from here on this launch writes into the run folder
        if env.rank == 0:
            save_tokenizer(tok, run_dir / "tokenizer.json")
        trainer.open_tracker()  # on the one rank that holds the reduced loss
        if env.rank == 0:
            (run_dir / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
            if args.print_config:
                print(dump_yaml(cfg), end="", flush=True)
            print(startup_view(args, cfg, env, trainer), flush=True)
            if trainer.schedule_note:  # a resume whose LR schedule changed: says how, after the view
                print(trainer.schedule_note, flush=True)

        summary = train_until_stopped(trainer)
        if summary.get("stopped"):
            trainer.close_tracker()
            if strategy.is_tracker:
                print(stop_line(summary["stopped"], summary["final_step"], summary["snapshot"],
                                launch_command(cfg.trainer.resume == "never")), flush=True)
            return stop_exit_code(summary["stopped"], env.distributed)

        # ---- outputs: consolidated weights, a short sample, the wandb summary. The run is complete
        # here (its final snapshot is written), so a failure in rank 0's file writes is one warning,
        # never an exit code. The gather is a collective every rank enters, so it is not guarded: a
        # rank that failed inside it and went on would strand the others in it.
        sd = strategy.full_model_state_dict()
        if env.rank == 0:
            _after_training("writing model.pt", lambda: trainer.write_model(run_dir / "model.pt", sd),
                            f"; python export.py --run-dir {run_dir} writes it from the final snapshot")
            if cfg.trainer.sample_tokens:
                _after_training("the sample", lambda: _write_sample(sd, gpt_cfg, tok, cfg, run_dir))
        env.barrier()
        if strategy.is_tracker:
            sample_path = run_dir / "sample.txt"
            sample = _after_training("reading the sample", lambda: sample_path.read_text(encoding="utf-8")) \
                if sample_path.is_file() else None
            trainer.close_tracker(summary, sample)
            print(f"done: step {summary['final_step']} | val loss {summary['val_loss']:.4f} | "
                  f"outputs in {run_dir}", flush=True)
    except Interrupted as e:  # a signal outside the step loop (stopping.py); main() ends the process
        if env.rank == 0:  # one line per job: every rank got the same signal
            final = str(trainer.last_snapshot) if summary is not None else None
            # this launch saved nothing (or finished): its own command, trainer.resume as it was
            print(interrupted_line(e.signum, launch_command(resume_never=False), final,
                                   Path(cfg.trainer.run_dir).expanduser()), flush=True)
        e.reported = True
        raise
    finally:
        if lock is not None:
            lock.release()
        if not keep_process_group:
            shutdown()
    return 0


def _fallback_corpus_run_dir(cfg, env) -> tuple[str, str] | None:
    """With trainer.run_dir at its default and data.path a URL that may fall back to the standard
    library's text, load the corpus now: a fallback run goes to FALLBACK_RUN_DIR (cfg is changed,
    so config.yaml and the run-folder lock name the folder really used). Every rank must agree,
    or some would train on another text: a job whose nodes disagree is refused. Returns the
    corpus for build_trainer, or None when the run folder cannot move."""
    if cfg.trainer.run_dir != TrainerConfig.run_dir or not cfg.data.offline_fallback \
            or not cfg.data.path.startswith(("http://", "https://")):
        return None
    corpus = load_corpus(cfg.data, is_local_leader=env.local_rank == 0, barrier=env.barrier,
                         fallback_run_dir=FALLBACK_RUN_DIR)
    fell_back = [corpus[1] == FALLBACK_SOURCE]
    if env.distributed:
        fell_back = [None] * env.world_size
        dist.all_gather_object(fell_back, corpus[1] == FALLBACK_SOURCE)
    if any(fell_back) and not all(fell_back):
        raise UsageError(f"only some nodes could download data.path (ranks {[r for r, f in enumerate(fell_back) if f]} "
                         f"would train on the fallback text); put the file into data.cache_dir on every "
                         f"node or set data.path to a local file")
    if all(fell_back):
        cfg.trainer.run_dir = FALLBACK_RUN_DIR
    return corpus


def _write_sample(sd, gpt_cfg, tok, cfg, run_dir: Path) -> None:
    (run_dir / "sample.txt").unlink(missing_ok=True)  # an older launch's sample is not this run's
    sampler = model_from_state(sd, gpt_cfg)
    sample = generate_text(sampler, tok, prompt=default_prompt(tok), tokens=cfg.trainer.sample_tokens,
                           seed=cfg.trainer.seed)
    (run_dir / "sample.txt").write_text(sample, encoding="utf-8")
    print(f"--- sample ---\n{sample}\n--------------", flush=True)


def _after_training(what: str, fn, fix: str = ""):
    """fn() for an output of a finished run; a failure is one warning line and returns None."""
    try:
        return fn()
    except Exception as e:  # the run is complete: nothing here may turn it into a failed one
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        warnings.warn(redact_url(f"{what} failed after training ({type(e).__name__}: {first}); the run "
                                 f"itself is complete{fix}"), stacklevel=2)
        return None


def error_line(e: BaseException) -> str | None:
    """The one line a refused launch ends with: bad input (UsageError) or a non-finite loss; None
    for any other exception (a bug: its traceback is the useful report)."""
    if isinstance(e, UsageError):
        return f"error: {e}"
    if isinstance(e, NonFiniteError):
        kept = (f"the newest snapshot {e.last_snapshot} stays the resume point" if e.last_snapshot
                else "no snapshot was written, so a relaunch starts from step 0")
        return (f"error: training stopped: {e.what}; nothing after it was saved and {kept}; lower "
                f"optimizer.lr or trainer.grad_clip (or use trainer.precision=fp32) and relaunch")
    return None


def _elastic_error_handler():
    """What `record` writes to this worker's TORCHELASTIC_ERROR_FILE, the file torchrun's failure
    summary shows (its py_callstack; without a file: "To enable traceback see ..."). For our one-line
    errors it holds that line instead of a traceback; other exceptions keep torch's traceback.

    Every rank meets the same bad input at about the same time, and torchrun's summary names the
    failure with the earliest error-file timestamp as root cause and lists every other failed rank
    with its own message. So a rank other than 0 waits before writing: when rank 0 refused too, the
    agent stops this rank during the wait (SIGTERM), and the line appears once in the summary (rank
    0's) and once on stderr (only rank 0 prints it); when only this rank refused, the summary shows
    its line after the wait."""

    class OneLineErrors(ErrorHandler):
        def initialize(self) -> None:  # faulthandler: only in a torchrun worker, not in a caller's process
            if self._get_error_file_path():
                super().initialize()

        def record_exception(self, e: BaseException) -> None:
            line, path = error_line(e), self._get_error_file_path()
            if line is None:
                return super().record_exception(e)
            if not path:  # not a torchrun worker: nothing reads an error file
                return None
            if int(os.environ.get("RANK", "0")) != 0:
                time.sleep(RANK0_FIRST_S)
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"message": {"message": line, "extraInfo": {
                    "py_callstack": line, "timestamp": str(int(time.time()))}}}, f)

    return OneLineErrors()


def main(argv=None, keep_process_group: bool = False) -> int:
    _one_line_warnings()
    # From here on a stop signal is one line, never a traceback (train_until_stopped records it instead)
    previous = {sig: signal.signal(sig, raise_interrupted) for sig in STOP_SIGNALS} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        code = record(run, error_handler=_elastic_error_handler())(sys.argv[1:] if argv is None else argv,
                                                                   keep_process_group)
        return 0 if code is None else code  # record() turns argparse's SystemExit(0) (--help) into None
    except Interrupted as e:  # run() reports it once the config exists; before that, here
        if int(os.environ.get("RANK", "0")) == 0 and not e.reported:
            print(interrupted_line(e.signum, launch_command(resume_never=False)), flush=True)
        die_by(e.signum)
        return 128 + e.signum  # only if the signal did not end the process
    except Exception as e:
        line = error_line(e)
        if line is None:
            raise
        if int(os.environ.get("RANK", "0")) == 0:  # one line per job: every rank meets the same input
            print(line, file=sys.stderr, flush=True)
        return 2 if isinstance(e, UsageError) else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
