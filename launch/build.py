"""From a checked config to a Trainer: corpus, tokenizer, model, strategy, in that order.

`build_trainer` is shared by main.py and the parity tests, so both build runs the same way.
`fallback_corpus` handles the one case where the corpus decides the run folder: the default
run_dir with a URL corpus that, offline, falls back to the standard library's text.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from char_dataset import CharDataset, TokenDataset
from config import Config, TrainerConfig, UsageError
from corpus.kinds import token_corpus_kind
from corpus.text import FALLBACK_RUN_DIR, FALLBACK_SOURCE, load_corpus
from corpus.token_files import corpus_tokenizer, open_token_corpus
from corpus.tokenizers import TOKENIZER_FILE, build_tokenizer, load_tokenizer_record
from model import GPT, GPTConfig, initial_tensor
from parallel.env import DistEnv
from parallel.registry import build_strategy
from snapshots.pretrained import Source, check_shape, check_tokenizer, initial_weights, open_source
from snapshots.validate import list_snapshots
from trainer import Trainer, seed_rng


def build_trainer(cfg: Config, env: DistEnv, run_dir: Path, corpus: tuple[str, str] | None = None) -> Trainer:
    """Corpus, tokenizer, model (the same initial weights in every layout), strategy and Trainer for `cfg` on this
    launch. `corpus`: load_corpus's (text, description) when the caller has loaded it already."""
    strategy = build_strategy(cfg, env)  # layout errors before any work
    stored = load_tokenizer_record(run_dir / TOKENIZER_FILE) if cfg.trainer.resume != "never" else None
    # model.init_from only starts a run: with snapshots to resume from, their weights win.
    resuming = cfg.trainer.resume != "never" and bool(list_snapshots(run_dir / "snapshots"))
    source = open_source(cfg.model.init_from) if cfg.model.init_from and not resuming else None
    if source is not None:
        stored = check_tokenizer(source, cfg.data.tokenizer, stored)
    data, tok, data_source = _open_data(cfg, env, stored, corpus, source)
    # ---- model: built on the meta device (no storage); the strategy splits and shards it, then
    # allocates this rank's share and fills it (parallel/materialize.py) from the seed or the file
    gpt_cfg = GPTConfig.of(cfg.model, tok.vocab_size)
    with torch.device("meta"):
        model = GPT(gpt_cfg)
    seed = cfg.trainer.seed
    if source is not None:
        check_shape(source, gpt_cfg)
        weights = initial_weights(model, source)
        initial = lambda part, name: weights[name]  # noqa: E731
    else:
        initial = lambda part, name: initial_tensor(part, name, seed)  # noqa: E731
    cost = model.cost()  # the whole model, before the strategy splits it
    strategy.setup(model, initial)
    seed_rng(cfg.trainer.seed, 0, strategy.dp_rank)  # dropout: per dp rank, shared by tp peers
    return Trainer(cfg, data, tok, strategy, run_dir, dataclasses.asdict(gpt_cfg), cost, data_source=data_source,
                   init_from=_path_of(source))


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
