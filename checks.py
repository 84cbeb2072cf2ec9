"""Every rule that holds a config against the rest of the project, in one place: the values each
key may take (section by section), the data source (corpus/kinds.py), the parallel keys
(parallel/options.py; with the world size, parallel/layout.py), wandb's (observe/wandb_limits.py).

`load_config` is how a config is loaded: config.py reads it (types only; it imports nothing of the
project), `validate` checks it. A problem is one UsageError line; the parallel keys' blockers are
all named in one, the world size first.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from config import (
    ATTENTION_KERNELS,
    COMPILE_SCOPES,
    CP_MODES,
    HOST_MEMORY,
    PP_SCHEDULES,
    PRECISIONS,
    STRATEGY_NAMES,
    TRAINER_PRECISIONS,
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainerConfig,
    UsageError,
    profile_window,
    read_config,
    suggest,
)
from corpus.kinds import data_problems
from observe.wandb_limits import wandb_problems
from parallel.options import problems as parallel_problems


def load_config(path: str | None, overrides: list[str] = (), world_size: int | None = None,
                adopt: Callable[[Config, set[str]], None] | None = None) -> Config:
    """config.read_config (defaults <- YAML <- overrides, then `adopt`), then validate()
    (`world_size`: the launch's, when known, so its blockers are reported with the config's)."""
    cfg = read_config(path, overrides, adopt)
    validate(cfg, world_size)
    return cfg


def _choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise UsageError(f"{key}='{value}' is not one of {', '.join(choices)}{suggest(value, choices)}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Checks that need only the config (and the world size, when given), section by section. The
    first problem is raised, except for the parallel keys, whose blockers are all named in one
    message, the world size first: fixing one must not reveal the next (the batch split and
    the pipeline: parallel/layout.py, Layout.of)."""
    _validate_data(cfg.data)
    _validate_model(cfg.model)
    _validate_trainer(cfg.trainer)
    _validate_optimizer(cfg.optimizer)
    _validate_parallel(cfg.parallel)
    blockers = list(parallel_problems(cfg, world_size))
    if blockers:
        raise UsageError(blockers[0] if len(blockers) == 1 else
                         f"{len(blockers)} problems: " + "; ".join(f"({i}) {b}" for i, b in enumerate(blockers, 1)))
    for problem in wandb_problems(cfg.wandb):
        raise UsageError(problem)


def _validate_data(d: DataConfig) -> None:
    _choice("data.tokenizer", d.tokenizer, ("char", "gpt2"))
    _positive("data.truncate", d.truncate, allow_zero=True)
    if not 0.0 < d.val_fraction < 1.0:
        raise UsageError(f"data.val_fraction must be between 0 and 1, got {d.val_fraction}")
    for problem in data_problems(d):
        raise UsageError(problem)


def _validate_model(m: ModelConfig) -> None:
    for k in ("n_layer", "n_head", "n_embd", "block_size"):
        _positive(f"model.{k}", getattr(m, k))
    if m.n_embd % m.n_head:
        raise UsageError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}; "
                         f"pick n_embd a multiple of n_head")
    if not 0.0 <= m.dropout < 1.0:
        raise UsageError(f"model.dropout must be in [0, 1), got {m.dropout}")
    _choice("model.gelu", m.gelu, ("erf", "tanh"))
    _choice("model.activation", m.activation, ("gelu", "relu2"))
    if m.init_from and not Path(m.init_from).expanduser().exists():
        raise UsageError(f"model.init_from '{m.init_from}' does not exist; give a Hugging Face GPT-2 "
                         f"folder (config.json + model.safetensors) or a run's model.pt")


def _validate_trainer(t: TrainerConfig) -> None:
    _positive("trainer.max_steps", t.max_steps)
    _positive("trainer.max_epochs", t.max_epochs, allow_zero=True)
    _positive("trainer.batch_size", t.batch_size)
    _positive("trainer.micro_batch_size", t.micro_batch_size, allow_zero=True)
    for k in ("eval_batches", "log_every", "keep_snapshots"):
        _positive(f"trainer.{k}", getattr(t, k))
    for k in ("eval_every", "save_every", "sample_tokens", "grad_clip", "peak_flops", "hang_timeout_s"):
        _positive(f"trainer.{k}", getattr(t, k), allow_zero=True)
    _choice("trainer.resume", t.resume, ("auto", "never", "require"))
    _choice("trainer.precision", t.precision, TRAINER_PRECISIONS)
    _choice("trainer.attention", t.attention, ATTENTION_KERNELS)
    _choice("trainer.host_memory", t.host_memory, HOST_MEMORY)
    _choice("trainer.compile_scope", t.compile_scope, COMPILE_SCOPES)
    _choice("trainer.device", t.device, ("auto", "cpu", "cuda"))
    profile_window(t.profile)
    if not t.run_dir:
        raise UsageError("trainer.run_dir is empty; name a folder for this run's outputs")


def _validate_optimizer(o: OptimizerConfig) -> None:
    _choice("optimizer.name", o.name, ("adamw", "muon"))
    _positive("optimizer.lr", o.lr)
    _positive("optimizer.min_lr", o.min_lr, allow_zero=True)
    if o.min_lr > o.lr:
        raise UsageError(f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}; lower min_lr")
    _positive("optimizer.warmup_steps", o.warmup_steps, allow_zero=True)
    _positive("optimizer.lr_decay_steps", o.lr_decay_steps, allow_zero=True)
    _positive("optimizer.weight_decay", o.weight_decay, allow_zero=True)
    for k in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, k) < 1.0:
            raise UsageError(f"optimizer.{k} must be in [0, 1), got {getattr(o, k)}")


def _validate_parallel(p: ParallelConfig) -> None:
    _choice("parallel.strategy", p.strategy, STRATEGY_NAMES)
    _positive("parallel.tp", p.tp)
    _positive("parallel.pp", p.pp)
    _positive("parallel.cp", p.cp)
    _choice("parallel.cp_mode", p.cp_mode, CP_MODES)
    _positive("parallel.dp_replicate", p.dp_replicate)
    _positive("parallel.bucket_cap_mb", p.bucket_cap_mb)
    if p.zero_stage not in (1, 2, 3):
        raise UsageError(f"parallel.zero_stage must be 1, 2 or 3, got {p.zero_stage}")
    _choice("parallel.mixed_precision", p.mixed_precision, ("none", "bf16", "fp16"))
    _choice("parallel.reduce_dtype", p.reduce_dtype, PRECISIONS)
    _choice("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES)
    _positive("parallel.microbatches", p.microbatches, allow_zero=True)
    _positive("parallel.pp_stages_per_rank", p.pp_stages_per_rank)
