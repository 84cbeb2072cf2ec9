"""Typed configuration: the YAML file, dotted command-line overrides, and validation.

Owns the dataclasses that every other module reads (`Config` and its sections), the reader that
turns `gpt2_train_cfg.yaml` + `key.sub=value` overrides into them (types checked), the choices of
the keys that name things, `UsageError`, the one exception type for bad user input (config, data,
snapshot, CLI): one line on stderr, exit code 2 (launch/errors.py), and the redaction of
credentials in URLs. It imports nothing of the project, so every module can import it; the rules
that hold a config against the rest live in checks.py (`checks.load_config` reads and checks).
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import re
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

DEFAULT_CONFIG = Path(__file__).resolve().parent / "gpt2_train_cfg.yaml"
TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


# the values of parallel.strategy (parallel/options.py maps them onto engines); auto: the planner
# picks the fastest layout that fits at launch
STRATEGY_NAMES = ("none", "dp", "ddp", "zero", "fsdp", "auto")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
PRECISIONS = ("fp32", "bf16", "fp16")
# trainer.precision also takes auto: the fastest the device has, chosen at launch (parallel/precision.py)
TRAINER_PRECISIONS = (*PRECISIONS, "auto")
ATTENTION_KERNELS = ("sdpa", "matmul")  # trainer.attention: model.py causal_attention, matmul_attention
HOST_MEMORY = ("lean", "reuse")  # trainer.host_memory: observe/host_memory.py
COMPILE_SCOPES = ("blocks", "model")  # trainer.compile_scope: parallel/parallelize.py step 4
# the values of parallel.cp_mode: how the cp ranks of one sequence see each other's keys and values
CP_MODES = ("ring", "allgather")


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
class ModelShape:
    """What the GPT computes, whatever its vocabulary: model.py's GPTConfig is this and the
    vocabulary size; ModelConfig is this and where a run's weights start."""
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True  # the LM head shares the token embedding matrix (GPT-2)
    # GELU form: "erf" is exact (torch's default, what this project always trained with); "tanh"
    # is the approximation GPT-2 was trained with (Hugging Face's "gelu_new"): imported GPT-2
    # weights need it to give GPT-2's logits.
    gelu: str = "erf"
    # Options of the modded-nanogpt speedruns (https://github.com/KellerJordan/modded-nanogpt), off by
    # default: "relu2" is the MLP activation relu(x)^2; qk_norm RMS-normalises q and k per head
    # (no weight, so every layout shards it as it shards q and k); zero_init_proj starts both output
    # projections of every block at zero, so each block begins as the identity.
    activation: str = "gelu"  # gelu | relu2
    qk_norm: bool = False
    zero_init_proj: bool = False


# What a model.pt, snapshot or GPT-2 from before a model setting existed computes: that setting's
# old behaviour (a key at this value leaves the model's fingerprint as it was).
BEFORE_THE_KEY = {"gelu": "erf", "activation": "gelu", "qk_norm": False}


@dataclass
class ModelConfig(ModelShape):
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
    precision: str = "fp32"  # fp32 | bf16 | fp16 | auto
    compile: bool = False
    compile_scope: str = "blocks"  # blocks | model (COMPILE_SCOPES): what trainer.compile compiles as one graph
    attention: str = "sdpa"  # sdpa | matmul (ATTENTION_KERNELS)
    host_memory: str = "lean"  # lean | reuse (HOST_MEMORY): glibc returns or keeps the steps' freed blocks
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
    cp: int = 1  # context parallel: each sequence split over this many ranks (parallel/cp.py)
    cp_mode: str = "ring"  # ring: K/V blocks passed around the cp ranks point to point | allgather: K/V gathered once
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
                 and (k, v) not in BEFORE_THE_KEY.items()}
        shape["tokenizer"] = self.data.tokenizer
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- loading


def suggest(name: str, choices) -> str:
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
        raise UsageError(f"config key '{dotted}' must look like section.key{suggest(dotted, sections)}")
    sec_name, key = parts
    if sec_name not in sections:
        raise UsageError(f"unknown config section '{sec_name}'{suggest(sec_name, sections)}; "
                         f"sections are: {', '.join(sections)}")
    section = getattr(cfg, sec_name)
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        full = [f"{sec_name}.{k}" for k in hints]
        raise UsageError(f"unknown config key '{dotted}'{suggest(dotted, full)}")
    if hints[key] is str and text is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = text
    setattr(section, key, _coerce(dotted, value, hints[key]))


def read_config(path: str | None, overrides: list[str] = (),
                adopt: Callable[[Config, set[str]], None] | None = None) -> Config:
    """Defaults <- YAML file <- `section.key=value` overrides, then `adopt(cfg, keys the user set)`
    (values taken from elsewhere, e.g. model.init_from's shape, where the user set none: on the
    command line or in a --config file other than the default one). Types are checked here, the
    rules by checks.py: load a config with checks.load_config, which does both."""
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
    return cfg


def profile_window(spec: str) -> tuple[int, int] | None:
    """trainer.profile: 'START:STEPS' -> (start, steps); '' -> None."""
    parts = spec.split(":")
    if spec and (len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[1]) < 1):
        raise UsageError(f"trainer.profile='{spec}' is not START:STEPS (two whole numbers, STEPS >= 1); "
                         f"e.g. trainer.profile=10:3 profiles steps 10, 11 and 12")
    return (int(parts[0]), int(parts[1])) if spec else None


# ----------------------------------------------------------------------------- credentials
# Credentials never leave the process: every URL the project writes or prints is redacted here
# (Config.to_dict, corpus/text.py's source line, the tracker, the launch's messages).

REDACTED = "***"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
# Query parameters that carry credentials: tokens, API keys, signed-URL signatures (S3's
# X-Amz-Signature / X-Amz-Credential, Azure SAS `sig`), passwords, session ids.
_SECRET_PARAM = re.compile(r"token|key|sig|pass|pwd|secret|auth|credential|session", re.IGNORECASE)


def _redact_one(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        # user:password -> user:***; a lone user part may itself be a token (https://TOKEN@host)
        netloc = f"{user.split(':', 1)[0]}:{REDACTED}@{host}" if ":" in user else f"{REDACTED}@{host}"
    query = "&".join(
        f"{k}={REDACTED}" if _SECRET_PARAM.search(k) and v else (f"{k}={v}" if sep else k)
        for k, sep, v in (item.partition("=") for item in parts.query.split("&"))) if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_url(text: str) -> str:
    """`text` with the credentials of every URL in it replaced by ***: the password of
    user:password@ (or a lone user part, often a token), and the values of query parameters whose
    names speak of a token, key, signature, password, secret, auth, credential or session.
    Everything the project writes or prints about the config or the corpus source goes through
    this one function (Config.to_dict, corpus/text.py's source line, warnings and errors); the real
    URL stays in the live config, and only the download uses it."""
    return _URL.sub(lambda m: _redact_one(m.group(0)), text)


def has_redacted_credentials(url: str) -> bool:
    """A URL whose credentials are the *** of a redacted copy (e.g. a run's config.yaml)."""
    probe = url.replace(REDACTED, "x")
    return REDACTED in url and redact_url(url) == url and redact_url(probe) != probe


def redact_strings(value):
    """`value` (nested dicts and lists, e.g. Config.to_dict) with every string's URLs redacted."""
    if isinstance(value, dict):
        return {k: redact_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_strings(v) for v in value]
    return redact_url(value) if isinstance(value, str) else value


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
