"""Run tracking: metrics.jsonl, wandb, and the terminal progress view.

Exactly one process (the Strategy's `is_tracker` rank, which holds the reduced loss) builds a
`RunTracker`; every other rank gets a `NullTracker` and never imports wandb.

One training run = one wandb run. Its id is made here before `wandb.init` (so it exists even
when wandb is off or broken), stored in every snapshot (`Trainer.state_meta()["tracker_run_id"]`)
and in `<run_dir>/tracker.json` together with the last step that went to wandb.

Resume rule: a restarted run resumes from snapshot step s and recomputes steps s+1.. that the
crashed launch may already have logged.
- metrics.jsonl is rewritten without rows past s, so the file is exactly the history of the
  training that survives (on CPU/fp32 the recomputed rows are bit-identical anyway).
- wandb cannot delete logged history and drops steps below its current step, so the tracker
  continues the same run id with resume="allow" and logs only steps greater than the last one
  the run holds (tracker.json; online, also `run.step` reported by the server).
An elastic restart (TORCHELASTIC_RESTART_COUNT > 0) before the first snapshot restarts at step 0
and is still the same run; a manual launch without a snapshot is a new run.

wandb failures (no network, bad key, service down) never stop training: one warning line, then
wandb is off for the rest of the launch while metrics.jsonl goes on. The API key is never printed
or written: wandb reads it from the environment itself, and warning texts are redacted. Credentials
in a data.path URL are redacted (config.py, redact_url) in the config and in the command line that
wandb records.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import string
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, TextIO

from tqdm import tqdm

from config import Config, redact_url
from parallel.env import restart_count
from storage.files import append_whole, atomic_write_text

TRACKER_FILE = "tracker.json"
METRICS_FILE = "metrics.jsonl"
_ID_CHARS = string.ascii_lowercase + string.digits


def new_run_id() -> str:
    """8 base-36 characters, the shape of wandb's own run ids (~2.8e12 of them)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(8))


def wandb_mode(cfg: Config) -> str:
    """wandb.enabled=false or mode=disabled -> disabled; else wandb.mode; else $WANDB_MODE; else
    online when WANDB_API_KEY is set and offline when not (never a login prompt)."""
    w = cfg.wandb
    if not w.enabled:
        return "disabled"
    return w.mode or os.environ.get("WANDB_MODE") or (
        "online" if os.environ.get("WANDB_API_KEY") else "offline")


def wandb_timeout() -> float:
    """Seconds wandb may block in init and in finish (uploads left over go to `wandb sync`)."""
    return float(os.environ.get("MINGPT_WANDB_TIMEOUT", 60))


def is_elastic_restart() -> bool:
    return restart_count() > 0


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _redact(text: str) -> str:
    key = os.environ.get("WANDB_API_KEY")
    return redact_url(text.replace(key, "***") if key else text)


@contextlib.contextmanager
def _redacted_argv():
    """wandb.init records the command line (Settings._args reads sys.argv) into the run's
    metadata, and a data.path=URL override may carry credentials."""
    argv = sys.argv
    sys.argv = [redact_url(a) for a in argv]
    try:
        yield
    finally:
        sys.argv = argv


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows with step > last_step (atomic rewrite); rows that do not parse are dropped too."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            keep.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in keep), durable=True)


class NullTracker:
    """What non-tracker ranks hold (and the Trainer's default): every call is a no-op."""
    run_id: str | None = None
    last_logged_step = -1

    def log(self, step: int, metrics: dict) -> None: ...
    def log_text(self, key: str, text: str) -> None: ...
    def summary(self, metrics: dict) -> None: ...
    def finish(self) -> None: ...


class RunTracker(NullTracker):
    """metrics.jsonl always; wandb when its mode is not disabled and it works."""

    def __init__(self, cfg: Config, run_dir: Path, resume_step: int | None = None,
                 resume_run_id: str | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.metrics_path = run_dir / METRICS_FILE
        self.state_path = run_dir / TRACKER_FILE
        run_dir.mkdir(parents=True, exist_ok=True)
        prior = _read_json(self.state_path)
        if resume_step is None and not is_elastic_restart():
            # a fresh start: whatever history this folder holds belongs to an older run
            self.metrics_path.unlink(missing_ok=True)
            prior = {}
        else:
            truncate_metrics(self.metrics_path, resume_step or 0)
        self.run_id = resume_run_id or prior.get("run_id") or new_run_id()
        # the last step this wandb run holds; only trusted when tracker.json speaks of this run
        self.last_logged_step = -1
        if prior.get("run_id") == self.run_id:
            self.last_logged_step = int(prior.get("last_logged_step", -1))
        self.mode = wandb_mode(cfg)
        self._wandb = None
        self._logged_this_launch = False
        self._storage_warned = False  # one warning per launch for rows the storage refused
        self._init_wandb()
        self._save_state()

    # ------------------------------------------------------------------ wandb

    def _warn(self, what: str, err: BaseException) -> None:
        first = str(err).splitlines()[0][:160] if str(err).strip() else ""
        warnings.warn(_redact(f"wandb {what} failed ({type(err).__name__}: {first}); training goes "
                              f"on without wandb, metrics stay in {self.metrics_path}"), stacklevel=3)

    def _init_wandb(self) -> None:
        if self.mode == "disabled":
            return
        w = self.cfg.wandb
        try:
            # imported only for a run that logs to wandb: the import alone takes about a second
            import wandb
            wdir = Path(w.dir).expanduser() if w.dir else self.run_dir
            wdir.mkdir(parents=True, exist_ok=True)
            with _redacted_argv():
                self._wandb = wandb.init(
                    project=w.project, entity=w.entity or None, name=w.name or self.run_dir.name,
                    group=w.group or None, tags=list(w.tags) or None, dir=str(wdir), mode=self.mode,
                    id=self.run_id, resume="allow", config=self.cfg.to_dict(), allow_val_change=True,
                    settings=wandb.Settings(init_timeout=wandb_timeout(), finish_timeout=wandb_timeout(),
                                            console="off", silent=True),
                )
            # online resume: the server knows the last step it holds (the next one is run.step)
            self.last_logged_step = max(self.last_logged_step, int(self._wandb.step) - 1)
        except Exception as e:  # no network, bad key, service down, wandb missing pieces
            self._warn("init", e)
            self._wandb = None
            return
        try:  # one line to find the run again; never worth failing for
            where = (self._wandb.url if self.mode == "online" else
                     f"{self._wandb.settings.sync_dir} (upload later: wandb sync <that folder>)")
        except Exception:
            where = "?"
        cont = f", continuing after step {self.last_logged_step}" if self.last_logged_step >= 0 else ""
        print(f"wandb: {self.mode} run {self.run_id}{cont}: {where}", flush=True)

    def _wandb_call(self, what: str, fn: Callable[[], None]) -> bool:
        if self._wandb is None:
            return False
        try:
            fn()
            return True
        except Exception as e:
            self._warn(what, e)
            self._wandb = None
            return False

    # ------------------------------------------------------------------ logging

    def _save_state(self) -> None:
        atomic_write_text(self.state_path, json.dumps({"run_id": self.run_id,
                                                       "last_logged_step": self.last_logged_step}))

    def log(self, step: int, metrics: dict) -> None:
        """One row: to metrics.jsonl always, to wandb only if the wandb run lacks this step."""
        try:
            append_whole(self.metrics_path, (json.dumps({"step": step, **metrics}) + "\n").encode("utf-8"))
        except OSError as e:
            self._storage_warning(step, e)
        if step > self.last_logged_step and self._wandb_call(
                "log", lambda: self._wandb.log(metrics, step=step)):
            self.last_logged_step = step
            self._logged_this_launch = True
            try:
                self._save_state()
            except OSError as e:
                self._storage_warning(step, e)

    def _storage_warning(self, step: int, e: OSError) -> None:
        """A row the storage refused (a full disk): one warning per launch, and training goes on.
        Only this rank writes rows, so stopping here would strand the others; the next snapshot
        save meets the same storage and stops every rank together (snapshots/store.py), and the
        relaunch computes and writes again every row after the snapshot it resumes from."""
        if not self._storage_warned:
            self._storage_warned = True
            warnings.warn(f"the metrics row of step {step} cannot be written to {self.run_dir} ({e.strerror or e}); "
                          f"training goes on, and a snapshot the storage refuses stops the run", stacklevel=3)

    def log_text(self, key: str, text: str) -> None:
        """A text (the final sample): an HTML panel in the last row, and the raw text in the summary."""
        def go():
            import wandb  # already imported by _init_wandb (a wandb run exists): binds the name
            panel = {key: wandb.Html(f"<pre>{_html_escape(text)}</pre>")}
            # join this launch's last row; with none logged let wandb pick its next step
            step = self.last_logged_step if self._logged_this_launch else None
            self._wandb.log(panel, step=step)
            self._wandb.summary[f"{key}_text"] = text
        self._wandb_call("log", go)

    def summary(self, metrics: dict) -> None:
        def go():
            for k, v in metrics.items():
                self._wandb.summary[k] = v
        self._wandb_call("summary", go)

    def finish(self) -> None:
        self._wandb_call("finish", lambda: self._wandb.finish())
        self._wandb = None


def _html_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Progress:
    """What the one tracker process shows while training: a live tqdm bar (step/total, ETA, rate,
    and a postfix with loss, lr, tokens/s, MFU) when `stream` is a terminal, else one plain line
    per log step (CI logs and files get no carriage-return noise)."""

    def __init__(self, total: int, start: int, enabled: bool, stream: TextIO | None = None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.total = total
        self.start = start
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled and self.stream.isatty():
            self.bar = tqdm(total=total, initial=start, file=self.stream, dynamic_ncols=True,
                            unit="step", smoothing=0.1)

    def update(self, step: int, m: dict) -> None:
        """Called on log steps with the number of steps done and that step's metrics row."""
        if not self.enabled:
            return
        text = (f"loss {m['loss']:.4f} | lr {m['lr']:.2e} | {m['tokens_per_sec']:,.0f} tok/s | "
                f"mfu {100 * m['mfu']:.1f}%")
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            # ETA from this launch's wall clock (eval and snapshot time included), not from start 0
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(step - self.start, 1) * (self.total - step)
            print(f"step {step}/{self.total} ({100 * step / self.total:.0f}%) | {text} | "
                  f"eta {_fmt_time(eta)}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
