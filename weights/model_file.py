"""model.pt: a run's weights as one plain file, built, written and read here and nowhere else.

The payload is plain tensors and plain data (the model's state dict under its single-process
names, the model shape, the resolved config, the tokenizer record, the step), so
`torch.load(path, weights_only=True)` reads it and nothing is unpickled. main.py writes it at the
end of a run, export.py from any snapshot; sample.py and `model.init_from` read it with the same
checks. `LazyTensors`: weights by name read one tensor at a time (`model.init_from`'s model.pt,
memory-mapped, and its Hugging Face folders: weights/pretrained.py; a snapshot's tensors for
export.py; the tensors a run gathers at its end).

Written one tensor at a time (weights/tensor_files.py): the file's layout (the pickle, every
tensor's place) follows from model_config alone, so it is written first, and then each tensor is
asked for, written and dropped. The writer never holds the whole model, whatever the layout that
trained it: a sharded run gathers one parameter at a time (Strategy.full_tensors).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from config import UsageError
from model import GPT, GPTConfig
from snapshots.format import SnapshotMeta
from storage.files import atomic_write
from weights.tensor_files import save_torch, storage_owners

MODEL_FILE = "model.pt"  # the run's final model, in its run folder
_REQUIRED = ("model", "model_config", "tokenizer")
MISSING = "train first (python main.py) or export a snapshot (python export.py --run-dir ...)"


@dataclass
class ModelFile:
    model: Mapping[str, torch.Tensor]  # single-process parameter names -> tensors (a dict, or LazyTensors)
    model_config: dict  # GPTConfig fields
    tokenizer: dict  # the tokenizer record (corpus/tokenizers.py)
    config: dict  # the resolved config of the run that trained it
    step: int | None  # the optimizer step the weights are from (None: written before steps were recorded)

    @classmethod
    def from_snapshot(cls, meta: SnapshotMeta, state_dict: Mapping) -> "ModelFile":
        return cls(state_dict, meta.model_config, meta.tokenizer, meta.config, meta.step)

    def payload(self) -> dict:
        return {"model": self.model, "model_config": self.model_config, "config": self.config,
                "tokenizer": self.tokenizer, "step": self.step}

    def build_model(self) -> GPT:
        """The GPT these weights belong to, in eval mode. It is built on the meta device and takes
        the tensors themselves (memory-mapped ones stay mapped): the weights are held once."""
        with torch.device("meta"):
            model = GPT(GPTConfig(**self.model_config))
        owners = storage_owners(model_layout(self.model_config))
        read = {name: self.model[name] for name in dict.fromkeys(owners.values())}  # a tied tensor once
        model.load_state_dict({name: read[owner] for name, owner in owners.items()}, assign=True)
        if model.cfg.tie_weights:  # assign gives each name its own Parameter: tie them again
            model.lm_head.weight = model.tok_emb.weight
        return model.eval()


def model_layout(model_config: dict) -> dict[str, torch.Tensor]:
    """model.pt's state dict for a model of this shape, on the meta device (shapes, dtypes and
    the tied names' shared storage; no bytes)."""
    with torch.device("meta"):
        return dict(GPT(GPTConfig(**model_config)).state_dict())


def write_model_file(path: Path, model_file: ModelFile) -> None:
    """Whole or not at all (a reader never sees half a file), and durable before it is named;
    one tensor at a time (its layout from model_config first, then each tensor read from
    model_file.model and written). Written through a Python file, so a failed write surfaces as
    its OSError (a full disk: ENOSPC); torch writing to a path reports only 'unexpected pos'."""
    header = {k: v for k, v in model_file.payload().items() if k != "model"}

    def write(tmp: Path) -> None:
        with open(tmp, "wb+") as f:
            save_torch(f, header, "model", model_layout(model_file.model_config), lambda n: model_file.model[n])
    atomic_write(path, write, durable=True)


class LazyTensors(Mapping):
    """Tensors by name, each read from its file when asked for and not kept: the names and shapes are
    known without reading any. A rank that fills its share of the model (parallel/materialize.py)
    then holds one source tensor at a time, never the whole model."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor]):
        self.shapes, self._read = shapes, read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class InOrder(LazyTensors):
    """Tensors from a collective stream (Strategy.full_tensors): each must be asked for in the
    stream's order, once. `drain` runs the rest of the stream: every rank calls it, so a writer
    that stopped early (a full disk) never strands the other ranks inside a collective."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], stream: Iterator[tuple[str, torch.Tensor | None]]):
        super().__init__(shapes, self._next)
        self._stream = stream

    def _next(self, name: str) -> torch.Tensor:
        got, tensor = next(self._stream)
        if got != name:
            raise RuntimeError(f"asked for {name}, the gather is at {got}: tensors are read in the file's order")
        return tensor

    def drain(self) -> None:
        for _ in self._stream:
            pass


def read_model_file(path: Path, who: str = "", fix: str = "export it again with python export.py",
                    mmap: bool = False, missing: str = MISSING) -> ModelFile:
    """The model.pt at `path`, or a UsageError naming `who` reads it (e.g. 'model.init_from ') and
    what to do: `fix` for a damaged or foreign file, `missing` for none."""
    if not path.is_file():
        raise UsageError(f"{who}{path} not found; {missing}")
    try:
        with warnings.catch_warnings():  # torch warns about odd pickle headers: the one line below says it
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise UsageError(f"{who}{path} is not a readable model.pt ({type(e).__name__}); {fix}") from None
    if not isinstance(payload, dict) or not set(_REQUIRED) <= payload.keys():
        raise UsageError(f"{who}{path} is not a model.pt of this project (no {', '.join(_REQUIRED)}); {fix}")
    return ModelFile(payload["model"], dict(payload["model_config"]), dict(payload["tokenizer"]),
                     dict(payload.get("config") or {}), payload.get("step"))
