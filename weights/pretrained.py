"""GPT-2 weights in and out: `model.init_from` and `export.py --format hf`.

In: `model.init_from=PATH` starts a new run from the weights of a local Hugging Face GPT-2 folder
(config.json + model.safetensors, as `save_pretrained` writes it) or of a run's model.pt. Nothing
is unpickled: safetensors for the folder, `torch.load(weights_only=True)` for model.pt. The
source's shape and tokenizer must agree with the config (one line naming every difference).
Out: `write_hf` writes a model.pt's contents as a folder `transformers.GPT2LMHeadModel.from_pretrained`
loads, without needing transformers here.

Hugging Face's GPT-2 keeps GPT-2's original layout: q, k and v fused in one `c_attn`, and every
projection a `Conv1D`, whose weight is (in, out), the transpose of `nn.Linear`'s (out, in). This
model has separate q/k/v Linear layers (see model.py), so `c_attn` is split in three along its
output columns and every projection weight is transposed. The LM head is tied to `wte` in both.
"""
from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import safetensors
import torch

from config import BEFORE_THE_KEY, Config, UsageError
from storage.files import atomic_write
from weights.model_file import LazyTensors, ModelFile, model_layout, read_model_file
from weights.tensor_files import save_safetensors

GPT2_VOCAB = 50257  # the GPT-2 BPE (tiktoken r50k_base): what a Hugging Face GPT-2 folder tokenizes with
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which model.py uses
# Hugging Face's activation_function names -> model.gelu
HF_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "erf"}
TOKENIZER_FILE = "mingpt_tokenizer.json"  # the project's tokenizer record, beside an exported folder
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "bias", "tie_weights", "gelu", "activation", "qk_norm")


@dataclass
class Source:
    """What model.init_from points at: its GPTConfig fields, tokenizer record and weights
    (this project's parameter names, float32, each read when asked for: a model.pt memory-mapped,
    a safetensors file opened, not loaded)."""
    path: Path
    model_config: dict
    tokenizer: dict
    weights: LazyTensors
    trained_on: str = ""  # the corpus it was trained on, when known (a run's model.pt: its data.path)


def open_source(path_text: str) -> Source:
    path = Path(path_text).expanduser()
    if path.is_dir():
        return _open_hf(path)
    return _open_model_pt(path)


def _open_model_pt(path: Path) -> Source:
    mf = read_model_file(path, who="model.init_from ", fix="give a run's model.pt or a Hugging Face GPT-2 folder",
                         mmap=True)  # each tensor's pages are read when that tensor is
    trained_on = str(mf.config.get("data", {}).get("path", ""))  # redacted when written (Config.to_dict)
    weights = LazyTensors({k: tuple(v.shape) for k, v in mf.model.items()}, lambda k: mf.model[k].float())
    return Source(path, mf.model_config, mf.tokenizer, weights, trained_on)


def _open_hf(path: Path) -> Source:
    def refuse(problem: str):
        raise UsageError(f"model.init_from {path}: {problem}")

    cfg, tokenizer = _hf_header(path, refuse)
    tensors = {}  # name -> (the open file that holds it, its shape): nothing is read yet
    for file in _safetensors_files(path, refuse):
        try:
            handle = safetensors.safe_open(str(file), framework="pt")
            tensors.update({name: (handle, tuple(handle.get_slice(name).get_shape())) for name in handle.keys()})
        except Exception as e:
            refuse(f"{file.name} is not a readable safetensors file ({type(e).__name__}); download or "
                   f"save it again")
    return Source(path, cfg, tokenizer, _from_hf(tensors, cfg, refuse))


def _hf_header(path: Path, refuse) -> tuple[dict, dict]:
    """(GPTConfig fields, tokenizer record) of a Hugging Face GPT-2 folder, from its config.json
    (and the tokenizer record export.py writes beside it): no weights are read."""
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        refuse(f"no readable config.json ({type(e).__name__}); give a folder written by "
               f"save_pretrained or a run's model.pt")
    if not isinstance(hf, dict) or hf.get("model_type") != "gpt2":
        refuse(f"model_type is {hf.get('model_type') if isinstance(hf, dict) else None!r}, not 'gpt2'; "
               f"only GPT-2 checkpoints map onto this model")
    act = hf.get("activation_function", "gelu_new")
    if act not in HF_GELU:
        refuse(f"activation_function '{act}' has no counterpart here (only {', '.join(HF_GELU)})")
    for key, want in (("layer_norm_epsilon", LAYER_NORM_EPS), ("scale_attn_weights", True),
                      ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)):
        if hf.get(key, want) != want:
            refuse(f"{key}={hf.get(key)} differs from this model's {want}; it cannot be imported")
    n_embd = int(hf.get("n_embd", 768))
    if hf.get("n_inner") not in (None, 4 * n_embd):
        refuse(f"n_inner={hf['n_inner']} is not 4 x n_embd={4 * n_embd}, this model's MLP width")
    cfg = {"vocab_size": int(hf.get("vocab_size", GPT2_VOCAB)),
           "block_size": int(hf.get("n_positions", 1024)),
           "n_layer": int(hf.get("n_layer", 12)), "n_head": int(hf.get("n_head", 12)), "n_embd": n_embd,
           "bias": True, "tie_weights": bool(hf.get("tie_word_embeddings", True)), "gelu": HF_GELU[act]}
    record_file = path / TOKENIZER_FILE
    if record_file.is_file():  # written by export.py --format hf (char models, or gpt2)
        try:
            tokenizer = json.loads(record_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            refuse(f"{TOKENIZER_FILE} is damaged ({type(e).__name__}); export the folder again")
    elif cfg["vocab_size"] == GPT2_VOCAB:
        tokenizer = {"kind": "gpt2", "encoding": "r50k_base"}
    else:
        refuse(f"vocab_size={cfg['vocab_size']} is not GPT-2's {GPT2_VOCAB} and there is no "
               f"{TOKENIZER_FILE}; only the GPT-2 tokenizer can be matched")
    return cfg, tokenizer


# GPT-2's published sizes (Radford et al. 2019, table 2; Hugging Face's gpt2* configs): model.size
GPT2_SIZES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
              "gpt2-xl": (48, 25, 1600)}  # name -> (n_layer, n_head, n_embd)


def adopt_model_shape(cfg: Config, explicit: set[str]) -> None:
    """The model shape from what names it, for every shape key the user did not set: a named
    GPT-2 size (model.size), then model.init_from's own shape (adopt_source_shape). A key the
    user set that contradicts the named size is refused, naming both."""
    if cfg.model.size:
        if cfg.model.size not in GPT2_SIZES:
            close = difflib.get_close_matches(cfg.model.size, list(GPT2_SIZES), n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UsageError(f"model.size='{cfg.model.size}' is not one of {', '.join(GPT2_SIZES)}{hint}; "
                             f"or leave it empty and set model.n_layer, n_head, n_embd")
        for key, value in zip(("n_layer", "n_head", "n_embd"), GPT2_SIZES[cfg.model.size]):
            if f"model.{key}" in explicit and getattr(cfg.model, key) != value:
                raise UsageError(f"model.size={cfg.model.size} has model.{key}={value} but model.{key}="
                                 f"{getattr(cfg.model, key)} is set too; remove one of them")
            setattr(cfg.model, key, value)
            explicit = explicit | {f"model.{key}"}
    adopt_source_shape(cfg, explicit)


def adopt_source_shape(cfg: Config, explicit: set[str]) -> None:
    """A new run from model.init_from takes the source's shape, GELU form and tokenizer for every
    such key the user did not set (on the command line or in a --config file): its config.json or
    model.pt holds them. A key the user did set keeps the user's value, and check_shape refuses it
    if it conflicts, naming both. Reads no weights (a model.pt is memory-mapped)."""
    path = Path(cfg.model.init_from).expanduser() if cfg.model.init_from else None
    if path is None or not path.exists():  # validation names a missing path
        return
    if path.is_dir():
        shape, tokenizer = _hf_header(path, lambda problem: _refuse_source(path, problem))
    else:
        mf = read_model_file(path, who="model.init_from ", mmap=True,
                             fix="give a run's model.pt or a Hugging Face GPT-2 folder")
        shape, tokenizer = {**BEFORE_THE_KEY, **mf.model_config}, mf.tokenizer
    for key in SHAPE_KEYS:
        if f"model.{key}" not in explicit and key in shape:
            setattr(cfg.model, key, shape[key])
    if "data.tokenizer" not in explicit and tokenizer.get("kind") in ("char", "gpt2"):
        cfg.data.tokenizer = tokenizer["kind"]


def _refuse_source(path: Path, problem: str):
    raise UsageError(f"model.init_from {path}: {problem}")


def _safetensors_files(path: Path, refuse) -> list[Path]:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():  # a sharded save: the index names the shard of every tensor
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            refuse(f"{index.name} is damaged ({type(e).__name__})")
        if any(Path(n).name != n for n in names):  # shards live in the folder itself
            refuse(f"{index.name} names a file outside the folder")
        return [path / n for n in names]
    refuse("no model.safetensors (pytorch_model.bin is a pickle and is not read); save the model "
           "with safe_serialization (the default of save_pretrained)")


def _from_hf(tensors: dict, cfg: dict, refuse) -> LazyTensors:
    """Hugging Face GPT-2 tensor names and layout -> this model's names and layout, each tensor
    converted when it is read. `tensors`: name -> (open safetensors file, shape)."""
    # GPT2LMHeadModel prefixes "transformer."; a GPT2Model (and the original hub files) does not.
    hf = {k.removeprefix("transformer."): (k, *v) for k, v in tensors.items()}
    c = cfg["n_embd"]
    recipes: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]] = {}  # name -> (shape, read)

    def take(name: str, shape: tuple) -> tuple[str, object]:
        """(the file's own name, the open file) of HF tensor `name`, checked."""
        if name not in hf:
            refuse(f"tensor {name} is missing; the checkpoint is incomplete")
        key, handle, found = hf.pop(name)
        if found != shape:
            refuse(f"tensor {name} has shape {found}, config.json implies {shape}")
        return key, handle

    def whole(name: str, shape: tuple, transpose: bool = False) -> tuple[tuple, Callable]:
        key, handle = take(name, shape)
        read = (lambda: handle.get_tensor(key).float().t().contiguous()) if transpose else \
            (lambda: handle.get_tensor(key).float())
        return (shape[::-1] if transpose else shape), read

    recipes["tok_emb.weight"] = whole("wte.weight", (cfg["vocab_size"], c))
    recipes["pos_emb.weight"] = whole("wpe.weight", (cfg["block_size"], c))
    for i in range(cfg["n_layer"]):
        h, b = f"h.{i}.", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            recipes[b + ln + ".weight"] = whole(h + ln + ".weight", (c,))
            recipes[b + ln + ".bias"] = whole(h + ln + ".bias", (c,))
        (w_key, w_file), (b_key, b_file) = take(h + "attn.c_attn.weight", (c, 3 * c)), take(h + "attn.c_attn.bias", (3 * c,))
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):  # columns [q | k | v] of the fused layer
            cols = slice(j * c, (j + 1) * c)
            recipes[b + f"attn.{name}.weight"] = ((c, c), lambda f=w_file, k=w_key, s=cols:
                                                 f.get_slice(k)[:, s].float().t().contiguous())
            recipes[b + f"attn.{name}.bias"] = ((c,), lambda f=b_file, k=b_key, s=cols: f.get_slice(k)[s].float())
        for hf_name, name, shape in (("attn.c_proj", "attn.out_proj", (c, c)), ("mlp.c_fc", "mlp.fc", (c, 4 * c)),
                                     ("mlp.c_proj", "mlp.proj", (4 * c, c))):
            recipes[b + name + ".weight"] = whole(h + hf_name + ".weight", shape, transpose=True)
            recipes[b + name + ".bias"] = whole(h + hf_name + ".bias", (shape[1],))
        hf.pop(h + "attn.bias", None)  # older saves hold the causal-mask buffers: not weights
        hf.pop(h + "attn.masked_bias", None)
    recipes["ln_f.weight"] = whole("ln_f.weight", (c,))
    recipes["ln_f.bias"] = whole("ln_f.bias", (c,))
    if not cfg["tie_weights"]:
        if "lm_head.weight" not in hf:
            refuse("tie_word_embeddings is false but lm_head.weight is missing")
        recipes["lm_head.weight"] = whole("lm_head.weight", (cfg["vocab_size"], c))
    else:  # tied: the state dict names the one matrix twice
        hf.pop("lm_head.weight", None)
        recipes["lm_head.weight"] = recipes["tok_emb.weight"]
    if hf:
        refuse(f"unexpected tensor {sorted(hf)[0]} (and {len(hf) - 1} more): not a GPT-2 LM checkpoint")
    return LazyTensors({k: shape for k, (shape, _) in recipes.items()}, lambda k: recipes[k][1]())


def check_tokenizer(src: Source, tokenizer_kind: str, stored: dict | None) -> dict:
    """The tokenizer record a new run from `src` uses: the source's own (a char model's vocabulary
    is its id mapping). Refuses another data.tokenizer or a run folder that already stores another."""
    kind = src.tokenizer.get("kind")
    if kind != tokenizer_kind:
        raise UsageError(f"model.init_from {src.path} was trained with the {kind} tokenizer but "
                         f"data.tokenizer={tokenizer_kind}; set data.tokenizer={kind}")
    if stored is not None and stored != src.tokenizer:
        raise UsageError(f"the run folder's tokenizer.json differs from model.init_from {src.path}'s "
                         f"tokenizer; use another trainer.run_dir")
    return src.tokenizer


def check_shape(src: Source, gpt_cfg) -> None:
    """One line naming every model setting that differs from the source's."""
    mine = vars(gpt_cfg)
    theirs = {**BEFORE_THE_KEY, **src.model_config}
    diffs = [f"model.{k}={_show(theirs.get(k))} (config: {_show(mine[k])})"
             for k in SHAPE_KEYS if theirs.get(k) != mine[k]]
    if mine["block_size"] > src.model_config["block_size"]:
        diffs.append(f"model.block_size <= {src.model_config['block_size']} (config: {mine['block_size']})")
    if src.model_config["vocab_size"] != mine["vocab_size"]:
        diffs.append(f"vocabulary {src.model_config['vocab_size']} tokens (this run's tokenizer: "
                     f"{mine['vocab_size']})")
    if diffs:
        raise UsageError(f"model.init_from {src.path} needs {', '.join(diffs)}; set those values "
                         f"or pick another model.init_from")


def _show(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def initial_weights(model, src: Source) -> LazyTensors:
    """The source's weights by `model`'s parameter names, checked against its shapes (`model` may be
    on the meta device: only names and shapes are read, and no weight until it is asked for). A
    shorter context keeps the first position embeddings, as GPT-2 itself is cropped for shorter
    contexts."""
    block = model.cfg.block_size
    shapes = dict(src.weights.shapes)
    if "pos_emb.weight" in shapes:
        shapes["pos_emb.weight"] = (min(block, shapes["pos_emb.weight"][0]), *shapes["pos_emb.weight"][1:])
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"{k} is missing" for k in sorted(want.keys() - shapes.keys())]
    problems += [f"{k} is unexpected" for k in sorted(shapes.keys() - want.keys())]
    problems += [f"{k} has shape {shapes[k]}, not {want[k]}" for k in sorted(want.keys() & shapes.keys())
                 if shapes[k] != want[k]]
    if problems:  # a model.pt whose tensors do not match its own model_config
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise UsageError(f"model.init_from {src.path} holds tensors that do not fit its model_config "
                         f"({problems[0]}{more}); export it again with python export.py")
    return LazyTensors(shapes, lambda k: src.weights[k][:block] if k == "pos_emb.weight" else src.weights[k])



# ----------------------------------------------------------------------------- out


def write_hf(model_file: ModelFile, out: Path) -> None:
    """config.json + model.safetensors (+ the tokenizer record) of a model.pt's contents; the
    safetensors file one tensor at a time (each converted from model_file.model when written)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder for the Hugging Face export")
    m = {**BEFORE_THE_KEY, **model_file.model_config}
    if m["activation"] != "gelu" or m["qk_norm"]:
        raise UsageError(f"this model was trained with model.activation={m['activation']} "
                         f"qk_norm={str(m['qk_norm']).lower()}, which GPT-2's format cannot express; "
                         f"keep --format pt (its model.pt loads here with sample.py and model.init_from)")
    recipes = _hf_tensors(model_file.model, model_file.model_config)
    on_meta = _hf_tensors(model_layout(model_file.model_config), model_file.model_config)
    layout = {k: (tuple(t.shape), t.dtype) for k, t in ((k, make()) for k, make in on_meta.items())}
    config = _hf_config(model_file.model_config, gpt2=model_file.tokenizer.get("kind") == "gpt2")
    out.mkdir(parents=True, exist_ok=True)
    record = json.dumps(model_file.tokenizer, ensure_ascii=False)
    _atomic(out / "model.safetensors", lambda p: _save_safetensors(layout, lambda k: recipes[k](), p))
    _atomic(out / TOKENIZER_FILE, lambda p: p.write_text(record, encoding="utf-8"))
    _atomic(out / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8"))


def _hf_tensors(sd: Mapping[str, torch.Tensor], m: dict) -> dict[str, Callable[[], torch.Tensor]]:
    """GPT2LMHeadModel's tensor names -> how each is made from ours, read from `sd` when called (its
    Conv1D layers hold the transposed weights; c_attn fuses q, k, v). On a meta state dict the
    recipes give the shapes without bytes."""
    c = m["n_embd"]

    def bias(name: str, n: int) -> torch.Tensor:
        # Hugging Face's GPT-2 always has biases: a bias=False model gets zeros, the same function.
        return sd[name] if m["bias"] else torch.zeros(n, device=sd["ln_f.weight"].device)

    def same(name: str) -> Callable[[], torch.Tensor]:
        return lambda: sd[name]

    def transposed(name: str) -> Callable[[], torch.Tensor]:
        return lambda: sd[name].t()

    def biased(name: str, n: int) -> Callable[[], torch.Tensor]:
        return lambda: bias(name, n)

    t = {"transformer.wte.weight": same("tok_emb.weight"), "transformer.wpe.weight": same("pos_emb.weight")}
    for i in range(m["n_layer"]):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            t[h + ln + ".weight"] = same(b + ln + ".weight")
            t[h + ln + ".bias"] = biased(b + ln + ".bias", c)
        qkv = [b + f"attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]  # the fused layer's columns, in order
        t[h + "attn.c_attn.weight"] = lambda qkv=qkv: torch.cat([sd[p + ".weight"].t() for p in qkv], 1)
        t[h + "attn.c_attn.bias"] = lambda qkv=qkv: torch.cat([bias(p + ".bias", c) for p in qkv])
        for hf_name, name, n in (("attn.c_proj", "attn.out_proj", c), ("mlp.c_fc", "mlp.fc", 4 * c),
                                 ("mlp.c_proj", "mlp.proj", c)):
            t[h + hf_name + ".weight"] = transposed(b + name + ".weight")
            t[h + hf_name + ".bias"] = biased(b + name + ".bias", n)
    t["transformer.ln_f.weight"] = same("ln_f.weight")
    t["transformer.ln_f.bias"] = biased("ln_f.bias", c)
    if not m["tie_weights"]:
        t["lm_head.weight"] = same("lm_head.weight")
    return t


def _hf_config(m: dict, gpt2: bool) -> dict:
    """GPT2Config's fields for a model of shape `m` (`gpt2`: the GPT-2 BPE vocabulary)."""
    drop = m.get("dropout", 0.0)
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m["vocab_size"],
        "n_positions": m["block_size"], "n_embd": m["n_embd"], "n_layer": m["n_layer"], "n_head": m["n_head"],
        "n_inner": None, "activation_function": "gelu_new" if m.get("gelu", "erf") == "tanh" else "gelu",
        "resid_pdrop": drop, "embd_pdrop": drop, "attn_pdrop": drop, "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": m["tie_weights"], "use_cache": True,
        # <|endoftext|> of the GPT-2 BPE; a char vocabulary has no such token
        "bos_token_id": GPT2_VOCAB - 1 if gpt2 else None, "eos_token_id": GPT2_VOCAB - 1 if gpt2 else None,
    }


def _save_safetensors(layout: dict, read: Callable[[str], torch.Tensor], path: Path) -> None:
    """model.safetensors, one tensor at a time (weights/tensor_files.py), through a Python file:
    a write the storage refuses is the OSError it was."""
    with open(path, "wb") as f:
        save_safetensors(f, layout, read, metadata={"format": "pt"})


def _atomic(path: Path, write) -> None:
    # safetensors creates its file readable by the owner only; the folder is meant to be shared
    # like any file this user writes, so give every file the mode the umask allows.
    mask = os.umask(0)
    os.umask(mask)
    atomic_write(path, write, mode=0o666 & ~mask)
