"""The parameters the planner places: model.py's GPT as a list of shapes, and which of them each
pipeline rank holds in its tensor-parallel shape.

Owns the vocabulary of a config without training (`vocab_size`), the `GPTConfig` it implies
(`gpt_config`), the inventory of parameter tensors in `named_parameters()` order
(`parameter_inventory`, tests/test_planner.py checks it against the real model), the Megatron
splits of parallel/tp.py (`tp_local_shape`: column-parallel rows, row-parallel columns,
torch.chunk sizes) and the placement on pipeline stages of parallel.layout.Layout
(`held_tensors`: each stage its blocks, the first the embeddings, the last ln_f and the head,
and a copy of the tied embedding/head).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from config import Config, UsageError
from corpus.text import corpus_cache_path
from corpus.tokenizers import TOKENIZER_FILE, load_tokenizer_record
from model import GPTConfig
from planner.records import PlannedLayout
from planner.units import ceil_div, numel

GPT2_VOCAB = 50257  # tiktoken r50k_base, the GPT-2 BPE (char_dataset.GPT2Tokenizer)
PARAM_BYTES = 4  # the model's parameters (and so their gradients) are fp32 under every precision
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
LAYER_NORMS = ("ln_1", "ln_2", "ln_f")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of model.py's GPT: name, shape, and how parallel/tp.py splits it."""
    name: str
    shape: tuple[int, ...]
    tp_style: str  # col (Shard(0)) | row (Shard(1) weight) | replicate | vocab (Shard(0) if vocab-parallel)
    where: str  # embed | block | head
    block: int | None = None  # the transformer block's index when where == "block"

    @property
    def module(self) -> str:
        """The module that owns the tensor: 'ln_1' for blocks.0.ln_1.weight, 'tok_emb' for tok_emb.weight."""
        return self.name.split(".")[-2]


def vocab_size(cfg: Config) -> tuple[int, str]:
    """Vocabulary of this config without training: GPT-2 BPE's 50257, or the characters of the
    corpus when it is on disk (a local file or the cached download; a run folder's tokenizer.json
    wins, as it does for a resume). Falls back to Tiny Shakespeare's 65, said so in the source."""
    if cfg.data.tokenizer == "gpt2":
        return GPT2_VOCAB, "GPT-2 BPE"
    stored = Path(cfg.trainer.run_dir).expanduser() / TOKENIZER_FILE
    try:
        record = load_tokenizer_record(stored) or {}
        if record.get("kind") == "char":
            return len(record["chars"]), f"characters in {stored}"
    except (UsageError, KeyError, TypeError, AttributeError):  # damaged: the corpus decides
        pass
    path = Path(cfg.data.path).expanduser()
    if cfg.data.path.startswith(("http://", "https://")):
        path = corpus_cache_path(cfg.data)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return 65, "assumed: Tiny Shakespeare's 65 characters (corpus not on disk)"
    if cfg.data.truncate:
        text = text[:cfg.data.truncate]
    return len(set(text)), f"characters of {path}"


def gpt_config(cfg: Config, vocab: int) -> GPTConfig:
    return GPTConfig.of(cfg.model, vocab)


def parameter_inventory(g: GPTConfig) -> list[ParamSpec]:
    """model.GPT's parameters in named_parameters() order (a tied head is not listed twice)."""
    c = g.n_embd
    out = [ParamSpec("tok_emb.weight", (g.vocab_size, c), "vocab", "embed"),
           ParamSpec("pos_emb.weight", (g.block_size, c), "replicate", "embed")]
    for i in range(g.n_layer):
        out += _block_params(g, i)
    out += _norm_params(g, "ln_f", "head")
    if not g.tie_weights:
        out.append(ParamSpec("lm_head.weight", (g.vocab_size, c), "vocab", "head"))
    return out


def _block_params(g: GPTConfig, i: int) -> list[ParamSpec]:
    """Block i: ln_1, separate q/k/v (column-parallel), out_proj (row), ln_2, fc (column), proj (row)."""
    c, p = g.n_embd, f"blocks.{i}."

    def linear(name: str, out_f: int, in_f: int, style: str) -> list[ParamSpec]:
        specs = [ParamSpec(p + name + ".weight", (out_f, in_f), style, "block", i)]
        if g.bias:  # a column-parallel Linear splits its bias with its rows; a row-parallel one keeps it whole
            specs.append(ParamSpec(p + name + ".bias", (out_f,), "col" if style == "col" else "replicate", "block", i))
        return specs

    return [*_norm_params(g, p + "ln_1", "block", i),
            *(spec for proj in ("q_proj", "k_proj", "v_proj") for spec in linear("attn." + proj, c, c, "col")),
            *linear("attn.out_proj", c, c, "row"),
            *_norm_params(g, p + "ln_2", "block", i),
            *linear("mlp.fc", 4 * c, c, "col"),
            *linear("mlp.proj", c, 4 * c, "row")]


def _norm_params(g: GPTConfig, name: str, where: str, block: int | None = None) -> list[ParamSpec]:
    specs = [ParamSpec(name + ".weight", (g.n_embd,), "replicate", where, block)]
    if g.bias:
        specs.append(ParamSpec(name + ".bias", (g.n_embd,), "replicate", where, block))
    return specs


def tp_local_shape(spec: ParamSpec, tp: int, vocab_parallel: bool) -> tuple[int, ...]:
    """The tensor-parallel rank 0 share (DTensor Shard uses torch.chunk: the first ranks get
    ceil(dim / tp))."""
    s = list(spec.shape)
    if tp == 1:
        return tuple(s)
    if spec.tp_style == "col" or (spec.tp_style == "vocab" and vocab_parallel):
        s[0] = ceil_div(s[0], tp)
    elif spec.tp_style == "row":
        s[1] = ceil_div(s[1], tp)
    return tuple(s)


@dataclass(frozen=True)
class HeldTensor:
    """A parameter on one rank: its spec, its tensor-parallel shape, and whether this rank's
    optimizer steps it (a V-shape rank's second copy of the tied weight is left out)."""
    spec: ParamSpec
    shape: tuple[int, ...]
    in_optimizer: bool

    @property
    def elems(self) -> int:
        return numel(self.shape)


@dataclass(frozen=True)
class RankTensors:
    """Every parameter one pipeline rank holds (before data-parallel sharding), in stage order."""
    tensors: tuple[HeldTensor, ...]

    def __iter__(self):
        return iter(self.tensors)

    @property
    def elems(self) -> int:
        """All of them: the gradients a data-parallel step reduces."""
        return sum(t.elems for t in self.tensors)

    @property
    def root_elems(self) -> int:
        """Outside the blocks: embeddings, ln_f, head (FSDP2's root unit)."""
        return sum(t.elems for t in self.tensors if t.spec.where != "block")

    @property
    def block_elems(self) -> int:
        """All blocks of this rank's stages."""
        return sum(t.elems for t in self.tensors if t.spec.where == "block")

    @property
    def largest_block_elems(self) -> int:
        per_block: dict[int, int] = {}
        for t in self.tensors:
            if t.spec.block is not None:
                per_block[t.spec.block] = per_block.get(t.spec.block, 0) + t.elems
        return max(per_block.values(), default=0)

    @property
    def blocks(self) -> int:
        return len({t.spec.block for t in self.tensors if t.spec.block is not None})

    @property
    def layer_norm_elems(self) -> int:
        return sum(t.elems for t in self.tensors if t.spec.module in LAYER_NORMS)


def held_tensors(g: GPTConfig, lay: PlannedLayout) -> list[RankTensors]:
    """Per pp rank, every tensor it holds in its tensor-parallel shape. The tied weight's copy on
    the last stage is a separate tensor when another rank (or, V-shape, another stage module)
    holds the first; a V-shape rank leaves that copy out of the optimizer."""
    inv = parameter_inventory(g)
    if lay.pp == 1:
        placed = [[(t, True) for t in inv]]
    else:
        placed = [_pp_rank_tensors(g, lay, inv, r) for r in range(lay.pp)]

    def local(spec: ParamSpec, owned: bool) -> HeldTensor:
        return HeldTensor(spec, tp_local_shape(spec, lay.tp, lay.tp_vocab_parallel), owned)

    return [RankTensors(tuple(local(t, owned) for t, owned in held)) for held in placed]


def stage_tensors(g: GPTConfig, lay: PlannedLayout) -> list[RankTensors]:
    """Per pipeline stage, the tensors it holds in their tensor-parallel shape (the last stage's
    tied copy counted as its own): what a stage computes with, for the schedule's play."""
    inv = parameter_inventory(g)
    # every tensor computes, whichever optimizer steps it: the optimizer flag is left True
    return [RankTensors(tuple(HeldTensor(t, tp_local_shape(t, lay.tp, lay.tp_vocab_parallel), True)
                              for t, _ in _stage_specs(g, lay, inv, s, holds_first=False)))
            for s in range(lay.num_stages)]


def _pp_rank_tensors(g: GPTConfig, lay: PlannedLayout, inv: list[ParamSpec], r: int) -> list[tuple[ParamSpec, bool]]:
    stages = lay.stages_of(r)
    return [held for s in stages for held in _stage_specs(g, lay, inv, s, 0 in stages)]


def _stage_specs(g: GPTConfig, lay: PlannedLayout, inv: list[ParamSpec], s: int,
                 holds_first: bool) -> list[tuple[ParamSpec, bool]]:
    """Stage s's parameters, each with whether its rank's optimizer steps it (the tied weight's
    last-stage copy is left out where the same rank, `holds_first`, steps the first)."""
    counts, last = lay.stage_blocks, lay.num_stages - 1
    start = sum(counts[:s])
    blocks = range(start, start + counts[s])
    held = [(t, True) for t in inv if (t.where == "block" and t.block in blocks) or (t.where == "embed" and s == 0)
            or (t.where == "head" and s == last)]
    if s == last and g.tie_weights:
        copy_of = ParamSpec("lm_head.weight", (g.vocab_size, g.n_embd), "vocab", "head")
        held.append((copy_of, not holds_first))
    return held
