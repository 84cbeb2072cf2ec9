"""wandb's own limits on the `wandb.*` keys (wandb 0.31 Settings), checked with the config before
any training instead of inside wandb.init, where a failure would only turn wandb off with a
warning. Imports nothing of the project at run time: config.py's validation reads it."""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Iterator

from config import WandbConfig

MODES = ("online", "offline", "disabled")


def wandb_problems(w: WandbConfig) -> Iterator[str]:
    """wandb's own limits (wandb 0.31 Settings), checked before any training instead of inside
    wandb.init, where a failure would only turn wandb off with a warning."""
    if w.mode not in ("", *MODES):
        close = difflib.get_close_matches(w.mode, list(MODES), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        yield (f"wandb.mode='{w.mode}' is not one of online, offline, disabled or \"\" "
               f"(automatic: online when WANDB_API_KEY is set){hint}")
    for key in ("project", "entity"):
        value = getattr(w, key)
        if any(c in "/\\#?%:" for c in value) or len(value) > 128:
            yield (f"wandb.{key}='{value[:40]}' must be at most 128 characters, none of "
                   f"/ \\ # ? % :; rename it")
    if not w.project and w.enabled and w.mode != "disabled":
        yield ("wandb.project is empty; name a project (or set wandb.enabled=false)")
    for key in ("name", "group"):
        value = getattr(w, key)
        if "\n" in value or len(value) > 128:
            yield (f"wandb.{key} must be one line of at most 128 characters; shorten it")
    for tag in w.tags:
        if not 1 <= len(tag) <= 64:
            yield (f"wandb.tags entry '{tag[:70]}' must be 1 to 64 characters; shorten it")
    if w.dir and Path(w.dir).expanduser().exists() and not Path(w.dir).expanduser().is_dir():
        yield (f"wandb.dir '{w.dir}' is a file; point it at a folder (or leave it empty)")
