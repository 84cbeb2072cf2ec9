"""The rules a resume follows, beyond loading tensors: which launches are the same run.

A snapshot belongs to one run: one data stream (which tokens, in which order, which are held out)
and one model shape. A launch that would change either is refused, naming every difference
(`refuse_another_run`; another optimizer too: its state does not load into another's); a launch that resumes at its last step has nothing to do and says so
(`nothing_left_message`). Safe changes (more steps, another layout or world size, another LR) are
the Trainer's to apply. The RNG streams a snapshot keeps per rank: `rng_state`, `set_rng_state`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from config import BEFORE_THE_KEY, Config, UsageError
from snapshots.format import SnapshotMeta


def nothing_left_message(cfg: Config, run_dir: Path, step: int, max_steps: int, decay_steps: int) -> str:
    """The one line of a launch that resumed at or past its last step: nothing was run or written.
    `decay_steps`: the cosine length that keeps the run's LR curve."""
    t = cfg.trainer
    end = (f"trainer.max_epochs={t.max_epochs} ({max_steps} steps)" if t.max_epochs > 0
           else f"trainer.max_steps={max_steps}")
    longer = "a larger trainer.max_epochs" if t.max_epochs > 0 else f"trainer.max_steps=N above {step}"
    return (f"nothing left to train: {run_dir} is at step {step} and {end} ends there, so "
            f"nothing was run or written; to train longer relaunch with {longer} and "
            f"optimizer.lr_decay_steps={decay_steps} to keep this run's LR curve; to start fresh use another "
            f"trainer.run_dir")


def refuse_another_run(path: Path, meta: SnapshotMeta, cfg: Config, now: dict) -> None:
    """UsageError naming every setting that would make this launch another run than the
    snapshot's: another data stream (`now`: Trainer.data_stream) or another model shape."""
    old_cfg, recorded = meta.config, meta.data_position

    def was(dotted: str):
        section, key = dotted.split(".")
        return recorded.get(dotted, old_cfg.get(section, {}).get(key))

    def show(v) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    changes = [f"{k}={show(was(k))} (now {show(v)})" for k, v in now.items()
               if k != "corpus_sha256" and was(k) is not None and was(k) != v]
    stream_changed = bool(changes)
    old_sha = recorded.get("corpus_sha256")
    # A changed truncate or tokenizer changes the token stream anyway: name only those.
    if old_sha and old_sha != now["corpus_sha256"] and not any(
            c.startswith(("data.truncate=", "data.tokenizer=")) for c in changes):
        changes.append(f"corpus sha256={old_sha[:12]} (now {now['corpus_sha256'][:12]}: "
                       f"another corpus under data.path)")
        stream_changed = True
    shape_changed = meta.fingerprint != cfg.model_fingerprint()
    if shape_changed:
        current = dataclasses.asdict(cfg.model)
        for k, v in current.items():
            key = f"model.{k}"
            before = was(key) if was(key) is not None else BEFORE_THE_KEY.get(k)  # a snapshot from before the key
            if k not in ("dropout", "init_from", "size", "zero_init_proj") and key not in now and before is not None \
                    and before != v:
                changes.append(f"{key}={show(before)} (now {show(v)})")
        if not changes:  # a snapshot without a readable config
            changes.append(f"model {old_cfg.get('model', {})}")
    old_optimizer = old_cfg.get("optimizer", {}).get("name", "adamw")  # snapshots before the key: AdamW
    optimizer_changed = old_optimizer != cfg.optimizer.name  # its state (exp_avg, momentum_buffer) differs
    if optimizer_changed:
        changes.append(f"optimizer.name={old_optimizer} (now {cfg.optimizer.name})")
    if changes:
        what = " and ".join(w for w, on in (("model shape", shape_changed), ("data stream", stream_changed),
                                            ("optimizer", optimizer_changed)) if on)
        raise UsageError(f"snapshot {path} was trained with {', '.join(changes)} (a different {what}); "
                         f"use the snapshot's values or another trainer.run_dir")


def _cuda_in_use() -> bool:
    """Does this process draw random numbers on a CUDA device (dropout on GPU)?"""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def rng_state(gpus: list[int] = ()) -> dict[str, torch.Tensor]:
    """This process's generator states: the CPU one, and when CUDA is in use each of `gpus`' (dropout
    on GPU draws from them; without them a resumed GPU run replays step 0's masks). One GPU: key
    "cuda" (as every snapshot wrote before nn.DataParallel kept its replicas' GPUs); several (the
    replicas of nn.DataParallel): "cuda0", "cuda1", ... A resume that finds not every key of this
    launch in the snapshot (one written with another GPU count, or before this) derives every
    stream from (seed, step, dp rank) instead (Trainer.resume, with a note)."""
    state = {"cpu": torch.get_rng_state()}
    if _cuda_in_use() and gpus:
        if len(gpus) == 1:
            state["cuda"] = torch.cuda.get_rng_state(gpus[0])
        else:
            state.update({f"cuda{i}": torch.cuda.get_rng_state(i) for i in gpus})
    return state


def set_rng_state(state: dict[str, torch.Tensor], gpus: list[int] = ()) -> None:
    torch.set_rng_state(state["cpu"])
    if not _cuda_in_use():
        return
    if "cuda" in state and gpus:
        torch.cuda.set_rng_state(state["cuda"], gpus[0])
    for i in gpus:
        if f"cuda{i}" in state:
            torch.cuda.set_rng_state(state[f"cuda{i}"], i)
