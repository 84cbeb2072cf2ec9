"""model.pt: a run's weights as one plain file, built, written and read here and nowhere else.

The payload is plain tensors and plain data (the model's state dict under its single-process
names, the model shape, the resolved config, the tokenizer record, the step), so
`torch.load(path, weights_only=True)` reads it and nothing is unpickled. main.py writes it at the
end of a run, export.py from any snapshot; sample.py and `model.init_from` read it with the same
checks. `LazyTensors`: weights by name read one tensor at a time (`model.init_from`'s model.pt,
memory-mapped, and its Hugging Face folders: weights/pretrained.py).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from config import UsageError
from model import GPT, GPTConfig
from snapshots.format import SnapshotMeta
from storage.files import atomic_write

MODEL_FILE = "model.pt"  # the run's final model, in its run folder
_REQUIRED = ("model", "model_config", "tokenizer")
MISSING = "train first (python main.py) or export a snapshot (python export.py --run-dir ...)"


@dataclass
class ModelFile:
    model: dict[str, torch.Tensor]  # single-process parameter names -> plain tensors
    model_config: dict  # GPTConfig fields
    tokenizer: dict  # the tokenizer record (corpus/tokenizers.py)
    config: dict  # the resolved config of the run that trained it
    step: int | None  # the optimizer step the weights are from (None: written before steps were recorded)

    @classmethod
    def from_snapshot(cls, meta: SnapshotMeta, state_dict: dict) -> "ModelFile":
        return cls(state_dict, meta.model_config, meta.tokenizer, meta.config, meta.step)

    def payload(self) -> dict:
        return {"model": self.model, "model_config": self.model_config, "config": self.config,
                "tokenizer": self.tokenizer, "step": self.step}

    def build_model(self) -> GPT:
        """The GPT these weights belong to, in eval mode."""
        model = GPT(GPTConfig(**self.model_config))
        model.load_state_dict(self.model)
        return model.eval()


def write_model_file(path: Path, model_file: ModelFile) -> None:
    """Whole or not at all (a reader never sees half a file), and durable before it is named.
    torch.save writes through a Python file, so a failed write surfaces as its OSError (a full
    disk: ENOSPC); given a path, torch writes in C++ and reports only 'unexpected pos'."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(model_file.payload(), f)
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
