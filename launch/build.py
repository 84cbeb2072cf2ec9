"""From a checked config to the Trainer's parts: strategy, where the weights come from, corpus,
tokenizer, model, then optimizer, schedule, scaler, snapshots, peak, profiler and guards, in that order.

`build_parts` is shared by main.py (launch/app.py) and, through `build_trainer`, the parity tests,
so both build runs the same way; `place_model` and `assemble` also by the dry run.
`fallback_corpus` handles the one case where the corpus decides the run folder: the default
run_dir with a URL corpus that, offline, falls back to the standard library's text.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from char_dataset import CharDataset, TokenDataset
from config import Config, TrainerConfig, UsageError
from corpus.kinds import token_corpus_kind
from corpus.text import FALLBACK_RUN_DIR, FALLBACK_SOURCE, load_corpus
from corpus.token_files import corpus_tokenizer, open_token_corpus
from corpus.tokenizers import TOKENIZER_FILE, build_tokenizer, load_tokenizer_record
from guards.health import FiniteCheck
from guards.stop import StopRequest
from guards.stragglers import GpuBlockClock, StragglerWatch
from guards.watchdog import HangWatchdog
from launch.schedule import lr_factor, total_steps
from model import GPT, GPTConfig, ModelCost, initial_tensor
from observe.perf import Peak, set_fp32_matmul_mode
from observe.profiling import StepProfiler
from parallel.env import DistEnv
from parallel.materialize import InitialValue
from parallel.precision import resolve_precision
from parallel.registry import build_strategy
from parallel.strategy import Strategy
from snapshots.store import SnapshotManager
from trainer import Guards, Trainer, TrainerParts, seed_rng
from weights.pretrained import Source, check_shape, check_tokenizer, initial_weights, open_source


def build_trainer(cfg: Config, env: DistEnv, run_dir: Path, corpus: tuple[str, str] | None = None) -> Trainer:
    """A Trainer over build_parts' parts (the tests' and benchmarks' entry: a launch is built the same,
    trainer.precision=auto resolved as the launch resolves it)."""
    return Trainer(build_parts(resolve_precision(cfg, env.device)[0], env, run_dir, corpus))


def build_parts(cfg: Config, env: DistEnv, run_dir: Path, corpus: tuple[str, str] | None = None) -> TrainerParts:
    """Collective. Everything the Trainer runs with for `cfg` on this launch: the strategy (layout
    errors before any work), where the weights come from (start_from), the corpus and tokenizer,
    the model (the same initial weights in every layout) placed by the strategy, then the rest
    (assemble). `corpus`: load_corpus's (text, description) when the caller has loaded it already."""
    strategy = build_strategy(cfg, env)
    snapshots = SnapshotManager(run_dir, cfg.trainer.keep_snapshots, env.rank, env.distributed,
                                background=cfg.trainer.async_save)
    resume_from, source = start_from(cfg, snapshots)
    stored = load_tokenizer_record(run_dir / TOKENIZER_FILE) if cfg.trainer.resume != "never" else None
    if source is not None:
        stored = check_tokenizer(source, cfg.data.tokenizer, stored)
    data, tok, data_source = _open_data(cfg, env, stored, corpus, source)
    gpt_cfg = GPTConfig.of(cfg.model, tok.vocab_size)
    cost = place_model(strategy, gpt_cfg, cfg.trainer.seed, source)
    return assemble(cfg, data, tok, strategy, run_dir, dataclasses.asdict(gpt_cfg), cost, snapshots,
                    resume_from=resume_from, data_source=data_source, init_from=_path_of(source))


def place_model(strategy: Strategy, gpt_cfg: GPTConfig, seed: int, source: Source | None = None,
                watch_initial: Callable[[InitialValue], InitialValue] | None = None) -> ModelCost:
    """Collective. The model built on the meta device (no storage); the strategy splits and shards
    it, then allocates this rank's share and fills it (parallel/materialize.py) from the seed or
    `source`'s file. Returns what the whole model costs. Also the dry run's (tools/fake_world.py),
    which measures this on fake tensors: `watch_initial` wraps the initial-value function (the
    dry run counts what it allocates as host memory)."""
    with torch.device("meta"):
        model = GPT(gpt_cfg)
    if source is not None:
        check_shape(source, gpt_cfg)
        weights = initial_weights(model, source)
        initial = lambda part, name: weights[name]  # noqa: E731
    else:
        initial = lambda part, name: initial_tensor(part, name, seed)  # noqa: E731
    cost = model.cost()  # the whole model, before the strategy splits it
    strategy.setup(model, watch_initial(initial) if watch_initial else initial)
    seed_rng(seed, 0, strategy.dp_rank)  # dropout: per dp rank, shared by tp peers
    return cost


def start_from(cfg: Config, snapshots: SnapshotManager) -> tuple[tuple[Path, dict] | None, Source | None]:
    """Collective. Where this launch's weights come from, decided here only: the newest valid
    snapshot (trainer.resume auto or require), else model.init_from's file, else the seed. A
    snapshot wins over init_from (init_from only starts a run); a folder whose snapshots are all
    damaged is refused rather than trained from init_from or at random."""
    mode = cfg.trainer.resume
    found = None
    if mode == "never":
        if snapshots.has_any():
            raise UsageError(f"{snapshots.snap_dir} already holds snapshots and trainer.resume="
                             f"never; pick another trainer.run_dir or set trainer.resume=auto")
    else:
        found = snapshots.find_latest()
        if found is None and mode == "require":
            raise UsageError(f"trainer.resume=require but {snapshots.snap_dir} holds no valid "
                             f"snapshot; set trainer.resume=auto to start fresh")
        if found is None and cfg.model.init_from and snapshots.has_any():
            raise UsageError(f"{snapshots.snap_dir} holds no valid snapshot to resume; move that folder "
                             f"aside to start over from model.init_from")
    source = open_source(cfg.model.init_from) if cfg.model.init_from and found is None else None
    return found, source


def assemble(cfg: Config, data: TokenDataset, tok, strategy: Strategy, run_dir: Path, model_config: dict,
             cost: ModelCost, snapshots: SnapshotManager, **extra) -> TrainerParts:
    """Collective (the tracker rank shares its peak's label). The Trainer's parts around a placed
    model: optimizer, LR schedule, grad scaler, the MFU peak, the profiler and the guards. Also the
    dry run's (tools/fake_world.py), on fake tensors. `extra`: TrainerParts' optional fields."""
    env = strategy.env
    max_steps = total_steps(cfg, data)
    data.check_batch(cfg.trainer.batch_size)
    set_fp32_matmul_mode(strategy.device)  # before the peak: it assumes this mode
    peak = Peak(strategy.device, strategy.compute_precision, cfg.trainer.peak_flops, strategy.is_tracker)
    # a GPU's own time (guards/stragglers.py), per block: the blocks that run eager or as their own
    # compiled graph; not one inside a larger compiled graph, which its hooks would break at every
    # block (trainer.compile_scope=model, nn.DataParallel's compiled wrapper: one process, no straggler)
    blocks = [b for part in strategy.unwrapped() for b in getattr(part, "blocks", {}).values()]
    timed = [b for b in blocks if not cfg.trainer.compile or b._compiled_call_impl is not None]
    gpu_clock = GpuBlockClock(timed) if strategy.device.type == "cuda" else None
    guards = Guards(
        stop_request=StopRequest(),
        watchdog=HangWatchdog(cfg.trainer.hang_timeout_s, env.rank, env.world_size, env.local_rank,
                              env.distributed, run_dir),
        finite=FiniteCheck(strategy),
        stragglers=StragglerWatch(env.rank, env.world_size, env.local_rank, env.distributed, strategy.is_tracker,
                                  gpu_clock))
    return TrainerParts(
        cfg=cfg, data=data, tokenizer=tok, strategy=strategy, run_dir=run_dir, model_config=model_config,
        model_cost=cost, max_steps=max_steps, optimizer=strategy.build_optimizer(),
        lr_factor=functools.partial(lr_factor, cfg=cfg, max_steps=max_steps), scaler=strategy.make_grad_scaler(),
        snapshots=snapshots, peak=peak, peak_label=_shared_peak_label(peak, strategy),
        profiler=StepProfiler(cfg.trainer.profile, run_dir, env.rank, strategy.device, max_steps), guards=guards,
        **extra)


def _shared_peak_label(peak: Peak, strategy: Strategy) -> str:
    """The peak is looked up on the tracker rank only (it may measure); every rank learns its label."""
    shared = [peak.label]
    if strategy.env.distributed:
        dist.broadcast_object_list(shared, src=strategy.tracker_rank)
    return shared[0]


def _path_of(source: Source | None) -> Path | None:
    return source.path if source is not None else None


def _open_data(cfg: Config, env: DistEnv, stored: dict | None, corpus: tuple[str, str] | None,
               source: Source | None):
    """(dataset, tokenizer, description) of data.path: a text corpus (the local leader downloads,
    every rank reads the same text) or a token corpus read from disk (memmap), whose ids fix the
    tokenizer (a run folder's or init_from's must be the same)."""
    d = cfg.data
    if not token_corpus_kind(d.path):
        text, description = corpus or load_corpus(d, is_local_leader=env.local_rank == 0, barrier=env.barrier)
        tok = build_tokenizer(d.tokenizer, text, stored)
        try:
            ids = tok.encode(text)
        except UsageError as e:
            if source is None:
                raise
            trained = f" (trained on {source.trained_on})" if source.trained_on else ""
            raise UsageError(f"the corpus {description} does not fit the vocabulary of model.init_from "
                             f"{source.path}{trained}: {str(e).split(';')[0]}; fine-tune on text with only "
                             f"that model's characters (data.path=...)") from None
        return CharDataset(ids, cfg.model.block_size, d.val_fraction, cfg.trainer.seed), tok, description
    token_corpus = open_token_corpus(d.path, d.tokenizer, d.val_path)
    tok = build_tokenizer(d.tokenizer, "", corpus_tokenizer(token_corpus, stored))
    data = TokenDataset(token_corpus.train, token_corpus.val, cfg.model.block_size, cfg.trainer.seed,
                        digest=token_corpus.digest)
    return data, tok, token_corpus.description


def fallback_corpus(cfg: Config, env: DistEnv) -> tuple[str, str] | None:
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
