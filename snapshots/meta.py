"""The run's record inside a snapshot (meta.json) and the names of a snapshot folder.

`SnapshotMeta` is what a snapshot says about its run: the step, the resolved config, the model
shape and tokenizer (enough to rebuild the model without the config file), the data position,
and the layout that wrote it. snapshots/store.py writes and validates it; the Trainer, export.py
and sample.py read it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

META = "meta.json"
# 2: only tensors in DCP, param groups in meta.json["nontensor_state"] (1 had pickled param groups)
FORMAT_VERSION = 2


@dataclass
class SnapshotMeta:
    """The run's record in a snapshot's meta.json: enough to resume it, to refuse a launch that
    would be another run (data stream, model shape), and to rebuild the model and tokenizer
    without the config file."""
    step: int
    config: dict  # the whole resolved config (Config.to_dict)
    model_config: dict  # GPTConfig as a dict
    tokenizer: dict  # the tokenizer record (char vocabulary or gpt2)
    fingerprint: str  # Config.model_fingerprint(): what fixes the parameter shapes
    data_position: dict  # {"step", **Trainer.data_stream()}: batches are a pure function of these
    world_size: int
    strategy: str  # parallel.strategy of the writer
    mesh: dict  # {"pp", "dp", "tp"} of the writer: its RNG streams belong to that layout
    scaler: dict | None = None  # fp16 grad scaler state
    tracker_run_id: str | None = None  # the wandb run a resume continues

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "SnapshotMeta":
        """From a validated meta.json (which also holds this module's own keys: files, format)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"
