"""The learning-rate schedule: linear warmup then cosine decay (`lr_at`), the run's length in steps
(`total_steps`), and the `note:` lines of a schedule that does not do what its keys say: one that
never reaches its peak or floor within the run (`schedule_notes`), or one a resume changes
(`schedule_change`)."""
from __future__ import annotations

import dataclasses
import math

from char_dataset import TokenDataset
from config import Config
from snapshots.format import SnapshotMeta


def lr_at(step: int, cfg: Config, max_steps: int) -> float:
    """Linear warmup to optimizer.lr, then cosine decay to optimizer.min_lr over lr_decay_steps."""
    o = cfg.optimizer
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    decay = o.lr_decay_steps or max_steps
    if step >= decay:
        return o.min_lr
    progress = (step - o.warmup_steps) / max(1, decay - o.warmup_steps)
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (o.lr - o.min_lr)


def lr_factor(step: int, cfg: Config, max_steps: int) -> float:
    """lr_at as a multiple of optimizer.lr: what torch's LambdaLR multiplies each group's LR by."""
    return lr_at(step, cfg, max_steps) / cfg.optimizer.lr


def total_steps(cfg: Config, data: TokenDataset) -> int:
    """trainer.max_epochs (when > 0) converted to optimizer steps, else trainer.max_steps."""
    t = cfg.trainer
    if t.max_epochs > 0:
        return max(1, math.ceil(t.max_epochs * data.steps_per_epoch(t.batch_size)))
    return t.max_steps


def schedule_notes(cfg: Config, max_steps: int) -> list[str]:
    """`note:` lines for an LR schedule that never does what its keys say within this run: a
    warmup longer than the run never reaches optimizer.lr (one as long as the run reaches it at the
    last step, and never decays); a cosine longer than the run never
    reaches optimizer.min_lr (e.g. trainer.max_epochs on a small corpus gives fewer steps)."""
    o, notes = cfg.optimizer, []
    last = lr_at(max_steps - 1, cfg, max_steps)
    if o.warmup_steps == max_steps:  # the last step (max_steps - 1) runs at (max_steps / warmup) x lr = lr
        notes.append(f"note: optimizer.warmup_steps={o.warmup_steps} is the whole run ({max_steps} steps): the LR "
                     f"reaches optimizer.lr={o.lr:g} only at the last step and never decays; lower "
                     f"optimizer.warmup_steps (e.g. {max(1, max_steps // 10)})")
    elif o.warmup_steps > max_steps:
        notes.append(f"note: optimizer.warmup_steps={o.warmup_steps} is not shorter than the run ({max_steps} steps): "
                     f"the LR ends at {last:.3e} and never reaches optimizer.lr={o.lr:g}; lower "
                     f"optimizer.warmup_steps (e.g. {max(1, max_steps // 10)})")
    elif o.lr_decay_steps > max_steps:
        notes.append(f"note: optimizer.lr_decay_steps={o.lr_decay_steps} is longer than the run ({max_steps} steps): "
                     f"the LR ends at {last:.3e}, not optimizer.min_lr={o.min_lr:g}; set optimizer.lr_decay_steps=0 "
                     f"to decay over the run")
    return notes


def schedule_change(cfg: Config, data: TokenDataset, meta: SnapshotMeta, step: int,
                    max_steps: int) -> tuple[str | None, int | None]:
    """A resume runs the configured schedule from its step on (Trainer.resume), so training longer
    with lr_decay_steps=0 stretches the cosine and the LR jumps at the resume step. Returns (the
    one `note:` line saying so, with the LR the snapshot's own schedule would have continued with,
    or None; the cosine length the snapshot was trained with). A snapshot whose config lacks
    those keys (older runs) gets (None, None)."""
    old = meta.config
    try:
        opt = dataclasses.replace(cfg.optimizer, **{
            k: old["optimizer"][k] for k in ("lr", "min_lr", "warmup_steps", "lr_decay_steps")})
        tr = dataclasses.replace(cfg.trainer, **{k: old["trainer"][k] for k in ("max_steps", "max_epochs")})
    except (KeyError, TypeError):
        return None, None
    then = dataclasses.replace(cfg, optimizer=opt, trainer=tr)
    then_steps = total_steps(then, data)
    o = cfg.optimizer
    decay_then = opt.lr_decay_steps or then_steps
    decay_now = o.lr_decay_steps or max_steps
    changes = [f"optimizer.{k}={getattr(opt, k)} (now {getattr(o, k)})"
               for k in ("lr", "min_lr", "warmup_steps") if getattr(opt, k) != getattr(o, k)]
    if decay_now != decay_then:
        why = "optimizer.lr_decay_steps" if o.lr_decay_steps else "trainer.max_steps, as optimizer.lr_decay_steps=0"
        changes.append(f"the cosine now decays over {decay_now} steps ({why}), not {decay_then}; "
                       f"optimizer.lr_decay_steps={decay_then} keeps the snapshot's curve")
    if changes and step < max_steps:
        was, now = lr_at(step, then, then_steps), lr_at(step, cfg, max_steps)
        return (f"note: the LR schedule changes at the resume step: at step {step} the snapshot's "
                f"schedule would continue with lr {was:.3e}, now {now:.3e}, because " + "; ".join(changes)), decay_then
    return None, decay_then
