"""Typed configuration: the YAML file, dotted command-line overrides, and validation.

Owns the dataclasses that every other module reads (`Config` and its sections), the loader that
turns `gpt2_train_cfg.yaml` + `key.sub=value` overrides into them, and `UsageError`, the one
exception type for bad user input (config, data, snapshot, CLI): one line on stderr, exit code 2
(launch/errors.py). The rules of some sections live beside what they configure and are read here:
parallel/options.py, corpus/kinds.py, observe/wandb_limits.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from corpus.kinds import data_problems
from observe.redact import redact_strings
from observe.wandb_limits import wandb_problems
from parallel.options import PP_SCHEDULES, STRATEGY_NAMES
from parallel.options import problems as parallel_problems

DEFAULT_CONFIG = Path(__file__).resolve().parent / "gpt2_train_cfg.yaml"
TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


class UsageError(Exception):
    """Bad input from the user. The message is one line: the problem and the fix."""


@dataclass
class DataConfig:
    path: str = TINY_SHAKESPEARE_URL  # text file, http(s) URL downloaded once into cache_dir, or a token corpus
    sha256: str = TINY_SHAKESPEARE_SHA256  # expected hash of a downloaded file ("" = don't check)
    cache_dir: str = "~/.cache/mingpt-parallel"
    tokenizer: str = "char"  # char | gpt2
    truncate: int = 0  # keep only the first N characters (0 = whole corpus)
    val_fraction: float = 0.1  # the last fraction of the tokens is the validation split
    offline_fallback: bool = True  # URL unreachable and not cached: use the stdlib's .py text
    val_path: str = ""  # nanoGPT .bin data.path: its val file ("" = val.bin beside it)


@dataclass
class ModelConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    gelu: str = "erf"  # erf (exact) | tanh (GPT-2's approximation, needed by GPT-2 weights)
    activation: str = "gelu"  # gelu | relu2 (relu(x)^2, the speedruns' MLP)
    qk_norm: bool = False  # RMS-normalise q and k per head before attention
    zero_init_proj: bool = False  # both output projections of every block start at zero
    init_from: str = ""  # start a new run from weights: a Hugging Face GPT-2 folder or a model.pt
    size: str = ""  # a named GPT-2 shape (gpt2 | gpt2-medium | gpt2-large | gpt2-xl) for n_layer/n_head/n_embd


@dataclass
class TrainerConfig:
    max_steps: int = 2000
    max_epochs: float = 0.0  # > 0 overrides max_steps: epochs over the train split, in steps
    batch_size: int = 16  # GLOBAL batch: sequences per optimizer step, over all dp ranks (16: 1/2/4/8 ranks)
    micro_batch_size: int = 0  # sequences per forward/backward on one rank (0 = whole rank share)
    eval_every: int = 250
    eval_batches: int = 20
    log_every: int = 10
    save_every: int = 500  # 0 = only at the end
    keep_snapshots: int = 2
    run_dir: str = "runs/shakespeare_char"
    resume: str = "auto"  # auto | never | require
    seed: int = 1337
    precision: str = "fp32"  # fp32 | bf16 | fp16
    compile: bool = False
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    device: str = "auto"  # auto | cpu | cuda
    sample_tokens: int = 200  # length of the text sample written at the end (0 = none)
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU (0 = measure on CPU / table on GPU)
    profile: str = ""  # START:STEPS: a torch profiler trace of those steps per rank in run_dir/profile/ ("" = none)
    async_save: bool = False  # write snapshots in the background: the loop waits only for the copy to CPU memory
    hang_timeout_s: float = 300.0  # no step finished for this long: name the stuck rank, exit 4 (0 = off)
    deterministic: bool = False  # deterministic kernels (bit-exact resume on GPU): parallel/env.py deterministic_mode


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw | muon (Muon for the blocks' weight matrices, AdamW for the rest: parallel/muon.py)
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    lr_decay_steps: int = 0  # cosine decay length (0 = max_steps)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99


@dataclass
class ParallelConfig:
    strategy: str = "ddp"  # none | dp | ddp | zero | fsdp (ddp with one process = plain training)
    tp: int = 1
    pp: int = 1
    # ddp
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    # zero
    zero_stage: int = 1
    # fsdp
    reshard_after_forward: bool = True
    mixed_precision: str = "none"  # none | bf16 | fp16: FSDP2 param dtype (reduce in reduce_dtype)
    reduce_dtype: str = "fp32"  # fp32 | bf16 | fp16
    cpu_offload: bool = False
    dp_replicate: int = 1  # HSDP: replicate over this many groups of dp ranks, shard within each
    # any strategy
    activation_checkpointing: bool = False
    # tensor parallel
    tp_vocab_parallel: bool = False
    sequence_parallel: bool = False
    # pipeline parallel
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    microbatches: int = 0  # pipeline micro-batches per step (0 = per-rank batch / micro_batch_size, else pp)
    pp_split: str = ""  # comma-separated blocks per stage, e.g. "3,1" (empty = even split)
    pp_stages_per_rank: int = 1
    device_memory: str = ""  # strategy=auto: bytes a rank may use, e.g. 40GB ("" = the GPU's memory; CPU: no limit)
    auto_world_size: int = 0  # written by strategy=auto: the world size this layout was chosen for (0 = by hand)


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: str = ""  # online | offline | disabled ("" = $WANDB_MODE, else online iff WANDB_API_KEY is set)
    project: str = "mingpt-parallel"
    entity: str = ""
    name: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    dir: str = ""  # parent of wandb's wandb/ folder ("" = run_dir)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def to_dict(self) -> dict:
        """The config as plain data, for everything that writes or prints it (config.yaml,
        meta.json, model.pt, wandb, stdout): credentials in URLs are redacted (redact_url)."""
        return redact_strings(dataclasses.asdict(self))

    def model_fingerprint(self) -> str:
        """Hash of the parameter shapes and the function they compute: a snapshot only loads into
        the same. Left out: dropout, init_from and zero_init_proj (where and how a run starts: a
        resume loads the snapshot's weights), size (a name for n_layer/n_head/n_embd), and a key
        at the value every run had before it existed (older snapshots keep their hash)."""
        shape = {k: v for k, v in dataclasses.asdict(self.model).items()
                 if k not in ("dropout", "init_from", "zero_init_proj", "size")
                 and (k, v) not in (("gelu", "erf"), ("activation", "gelu"), ("qk_norm", False))}
        shape["tokenizer"] = self.data.tokenizer
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- loading


def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(key: str, value, ftype):
    """Check/convert one value to the field's declared type, or raise UsageError."""
    origin = typing.get_origin(ftype)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise UsageError(f"config key '{key}' must be a list of strings, got {value!r}")
        return [str(v) for v in value]
    if ftype is bool:
        if isinstance(value, bool):
            return value
        raise UsageError(f"config key '{key}' must be true or false, got {value!r}")
    if ftype is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UsageError(f"config key '{key}' must be an integer, got {value!r}")
    if ftype is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            with contextlib.suppress(ValueError):
                return float(value)
        raise UsageError(f"config key '{key}' must be a number, got {value!r}")
    if ftype is str:
        if value is None:  # YAML's empty value
            return ""
        if isinstance(value, (dict, list)):
            raise UsageError(f"config key '{key}' must be a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported field type {ftype}")


def _set(cfg: Config, dotted: str, value, text: str | None = None) -> None:
    """`text`: an override's value as typed; a string key keeps it when YAML read a number (YAML 1.1
    reads 3:2 as the base-60 number 182, 0x10 as 16); a list or mapping stays refused."""
    parts = dotted.split(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if len(parts) != 2:
        if len(parts) == 1 and parts[0] in sections:
            raise UsageError(f"config section '{dotted}' needs a key, e.g. {dotted}.<key>=<value>")
        raise UsageError(f"config key '{dotted}' must look like section.key{_suggest(dotted, sections)}")
    sec_name, key = parts
    if sec_name not in sections:
        raise UsageError(f"unknown config section '{sec_name}'{_suggest(sec_name, sections)}; "
                         f"sections are: {', '.join(sections)}")
    section = getattr(cfg, sec_name)
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        full = [f"{sec_name}.{k}" for k in hints]
        raise UsageError(f"unknown config key '{dotted}'{_suggest(dotted, full)}")
    if hints[key] is str and text is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = text
    setattr(section, key, _coerce(dotted, value, hints[key]))


def load_config(path: str | None, overrides: list[str] = (), world_size: int | None = None,
                adopt: Callable[[Config, set[str]], None] | None = None) -> Config:
    """Defaults <- YAML file <- `section.key=value` overrides, then `adopt(cfg, keys the user set)`
    (values taken from elsewhere, e.g. model.init_from's shape, where the user set none: on the
    command line or in a --config file other than the default one), then validate() (`world_size`:
    the launch's, when known, so its blockers are reported with the config's)."""
    cfg, explicit = Config(), set()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"config file '{path}' not found; pass an existing YAML with --config")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise UsageError(f"config file '{path}' is not valid YAML{at}; fix the syntax") from None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise UsageError(f"config file '{path}' must be a mapping of sections (data:, model:, ...)")
        for sec, body in raw.items():
            if body is None:
                continue
            if not isinstance(body, dict):
                raise UsageError(f"config section '{sec}' in '{path}' must be a mapping of keys")
            for key, value in body.items():
                _set(cfg, f"{sec}.{key}", value)
                if p.resolve() != DEFAULT_CONFIG.resolve():
                    explicit.add(f"{sec}.{key}")
    for item in overrides:
        if "=" not in item:
            raise UsageError(f"override '{item}' must look like section.key=value")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        _set(cfg, key.strip(), value, text)
        explicit.add(key.strip())
    if adopt is not None:
        adopt(cfg, explicit)
    validate(cfg, world_size)
    return cfg


# ----------------------------------------------------------------------------- validation


def _choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise UsageError(f"{key}='{value}' is not one of {', '.join(choices)}{_suggest(value, choices)}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def profile_window(spec: str) -> tuple[int, int] | None:
    """trainer.profile: 'START:STEPS' -> (start, steps); '' -> None."""
    parts = spec.split(":")
    if spec and (len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[1]) < 1):
        raise UsageError(f"trainer.profile='{spec}' is not START:STEPS (two whole numbers, STEPS >= 1); "
                         f"e.g. trainer.profile=10:3 profiles steps 10, 11 and 12")
    return (int(parts[0]), int(parts[1])) if spec else None


PRECISIONS = ("fp32", "bf16", "fp16")


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
    _choice("trainer.precision", t.precision, PRECISIONS)
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
    _positive("parallel.dp_replicate", p.dp_replicate)
    _positive("parallel.bucket_cap_mb", p.bucket_cap_mb)
    if p.zero_stage not in (1, 2, 3):
        raise UsageError(f"parallel.zero_stage must be 1, 2 or 3, got {p.zero_stage}")
    _choice("parallel.mixed_precision", p.mixed_precision, ("none", "bf16", "fp16"))
    _choice("parallel.reduce_dtype", p.reduce_dtype, PRECISIONS)
    _choice("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES)
    _positive("parallel.microbatches", p.microbatches, allow_zero=True)
    _positive("parallel.pp_stages_per_rank", p.pp_stages_per_rank)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
