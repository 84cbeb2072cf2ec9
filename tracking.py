"""Run tracking: metrics.jsonl, wandb, and the terminal progress view.

Exactly one process (the Strategy's `is_tracker` rank, which holds the reduced loss) builds a
`RunTracker`; every other rank gets a `NullTracker` and never imports wandb.

Resume rule (the same for metrics.jsonl and wandb): a restarted run resumes from snapshot step s
and recomputes steps s+1.. that the crashed run may already have logged.
- metrics.jsonl is rewritten without rows past s, so the file is exactly the history of the
  training that survives (on CPU/fp32 the recomputed rows are bit-identical anyway).
- wandb cannot delete logged history, and rejects steps below its current step, so the tracker
  logs only steps greater than the last one it logged (kept in the snapshot and in
  `<run_dir>/tracker.json`), continuing the same wandb run id with resume="allow".

wandb failures (no network, bad key, service down) never stop training: one warning line, then
wandb is off for the rest of the run while metrics.jsonl goes on. No API key is ever written.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

from config import Config

TRACKER_FILE = "tracker.json"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


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
        if isinstance(row, dict) and row.get("step", 0) <= last_step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(l + "\n" for l in keep), encoding="utf-8")
    os.replace(tmp, path)


class NullTracker:
    """What non-tracker ranks hold: every call is a no-op."""
    run_id: str | None = None
    last_logged_step = -1

    def log(self, step: int, metrics: dict) -> None: ...
    def log_text(self, key: str, text: str) -> None: ...
    def summary(self, metrics: dict) -> None: ...
    def finish(self) -> None: ...


class RunTracker(NullTracker):
    def __init__(self, cfg: Config, run_dir: Path, resume_step: int | None = None,
                 resume_run_id: str | None = None, resume_last_logged: int = -1):
        self.cfg = cfg
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.state_path = run_dir / TRACKER_FILE
        prior = _read_json(self.state_path)
        if resume_step is None:  # a fresh start: the folder's history is not ours
            self.metrics_path.unlink(missing_ok=True)
            prior = {}
        else:
            truncate_metrics(self.metrics_path, resume_step)
        # The wandb id: from the snapshot, else from this run folder (a crash before the first
        # snapshot restarts at step 0 but is still the same run), else a new one.
        self.run_id = resume_run_id or prior.get("run_id")
        self.last_logged_step = max(resume_last_logged, int(prior.get("last_logged_step", -1)))
        self._wandb = None
        self._init_wandb()
        self._save_state()

    # ------------------------------------------------------------------ wandb

    def _mode(self) -> str:
        w = self.cfg.wandb
        if not w.enabled:
            return "disabled"
        if w.mode:
            return w.mode
        env = os.environ.get("WANDB_MODE")
        if env:
            return env
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"

    def _warn(self, what: str, err: BaseException) -> None:
        msg = str(err).splitlines()[0][:160] if str(err) else ""
        warnings.warn(f"wandb {what} failed ({type(err).__name__}: {msg}); training goes on, "
                      f"metrics stay in {self.metrics_path}", stacklevel=3)

    def _init_wandb(self) -> None:
        mode = self._mode()
        if mode == "disabled":
            return
        w = self.cfg.wandb
        try:
            import wandb
            if self.run_id is None:
                self.run_id = wandb.util.generate_id()
            wdir = Path(w.dir or self.run_dir)
            wdir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=w.project, entity=w.entity or None, name=w.name or self.run_dir.name,
                group=w.group or None, tags=list(w.tags) or None, dir=str(wdir), mode=mode,
                id=self.run_id, resume="allow", config=self.cfg.to_dict(),
                settings=wandb.Settings(init_timeout=float(os.environ.get("MINGPT_WANDB_TIMEOUT", 60)),
                                        console="off", silent=True),
            )
            # online: wandb knows the last step it holds (its next step is run.step)
            self.last_logged_step = max(self.last_logged_step, int(getattr(self._wandb, "step", 0)) - 1)
        except Exception as e:  # no network, bad key, service down, wandb missing pieces
            self._warn("init", e)
            self._wandb = None

    def _wandb_call(self, what: str, fn) -> None:
        if self._wandb is None:
            return
        try:
            fn()
        except Exception as e:
            self._warn(what, e)
            self._wandb = None

    # ------------------------------------------------------------------ logging

    def _save_state(self) -> None:
        tmp = self.state_path.with_name(TRACKER_FILE + ".tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "last_logged_step": self.last_logged_step}))
        os.replace(tmp, self.state_path)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **metrics}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if step > self.last_logged_step:
            self._wandb_call("log", lambda: self._wandb.log(metrics, step=step))
            self.last_logged_step = step
            self._save_state()

    def log_text(self, key: str, text: str) -> None:
        def go():
            import wandb
            self._wandb.log({key: wandb.Html(f"<pre>{_html_escape(text)}</pre>")},
                            step=max(self.last_logged_step, 0))
            self._wandb.summary[key] = text
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
    """A live tqdm bar on a terminal; plain periodic lines otherwise (CI logs, files)."""

    def __init__(self, total: int, start: int, enabled: bool, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.total = total
        self.bar = None
        self.t0 = time.perf_counter()
        self.start = start
        if enabled and self.stream.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, file=self.stream, dynamic_ncols=True,
                            unit="step", smoothing=0.1)

    def update(self, step: int, m: dict) -> None:
        """Called on log steps with the step just finished (1-based count of steps done)."""
        if not self.enabled:
            return
        text = (f"loss {m['loss']:.4f} | lr {m['lr']:.2e} | {m['tokens_per_sec']:,.0f} tok/s | "
                f"mfu {100 * m['mfu']:.1f}%")
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            done = step - self.start
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done, 1) * (self.total - step)
            print(f"step {step}/{self.total} | {text} | eta {_fmt_time(eta)}", file=self.stream, flush=True)

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
