"""Plot the metrics.jsonl of one or several runs into one PNG: `python plot.py RUN_DIR [RUN_DIR ...] [--out FILE.png]`.

One panel per metric (train loss, val loss, learning rate, tokens/s, and every memory figure the
runs logged, i.e. every key ending in `_mb`), one line per run labelled by its run folder's name,
steps on the x axis. So runs, layouts and strategies can be compared without wandb. Drawn with
matplotlib's Agg renderer (no display needed).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from config import UsageError
from storage.files import atomic_write

# metric key -> panel title; memory keys (`*_mb`) are added per run set, after these
PANELS = {"loss": "train loss", "val_loss": "val loss", "lr": "learning rate", "tokens_per_sec": "tokens/s"}
LINESTYLES = ("-", (0, (5, 3)), (0, (1, 2)), (0, (5, 2, 1, 2)))  # solid, dashed, dotted, dash-dot
MARKERS = ("o", "s", "^", "D")  # per run, hollow, for series of fewer than 30 points
COLUMNS, PANEL_W, PANEL_H, DPI = 2, 6.0, 3.2, 100  # inches per panel; the PNG is COLUMNS*PANEL_W*DPI wide


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of `run_dir`/metrics.jsonl, or UsageError naming the problem."""
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise UsageError(f"run folder {run_dir} not found; pass folders that main.py trained into "
                         f"(trainer.run_dir)")
    if not path.is_file():
        raise UsageError(f"{run_dir} has no metrics.jsonl; is it a run folder? (main.py writes it at "
                         f"the first log step, trainer.log_every)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is unreadable ({type(e).__name__}); check the file") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UsageError(f"{path} line {n} is not a metrics row (a JSON object with an integer "
                             f"'step'); fix or remove that line")
        rows.append(row)
    if not rows:
        raise UsageError(f"{path} is empty: the run has not logged a step yet; plot it after its "
                         f"first log step (trainer.log_every)")
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that carry `key` as a number, by step."""
    points = sorted((r["step"], float(r[key])) for r in rows
                    if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool))
    return [s for s, _ in points], [v for _, v in points]


def labels(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name, or its path as given where two runs share a name."""
    names = [p.resolve().name for p in run_dirs]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, run_dirs)]


def plot(run_dirs: list[Path], out: Path) -> list[str]:
    """Draw the runs' metrics into the PNG `out`; returns the panel keys drawn."""
    runs = [(label, read_metrics(p)) for label, p in zip(labels(run_dirs), run_dirs)]
    fig, keys = draw(runs)
    atomic_write(out, lambda tmp: fig.savefig(tmp, format="png"))
    return keys


def draw(runs: list[tuple[str, list[dict]]]) -> tuple[Figure, list[str]]:
    """The figure of (label, rows) runs: one panel per metric, one line per run."""
    memory = sorted({k for _, rows in runs for r in rows for k in r if k.endswith("_mb")})
    keys = [k for k in [*PANELS, *memory] if any(series(rows, k)[0] for _, rows in runs)]
    if not keys:
        raise UsageError(f"no metric to plot in the runs {', '.join(label for label, _ in runs)}: the rows carry "
                         f"none of {', '.join([*PANELS, '*_mb'])}")
    nrows = math.ceil(len(keys) / COLUMNS)
    fig = Figure(figsize=(COLUMNS * PANEL_W, nrows * PANEL_H + 0.6), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, COLUMNS, squeeze=False).ravel()
    steps = [r["step"] for _, rows in runs for r in rows]
    for ax, key in zip(axes, keys):
        _panel(ax, key, [(label, *series(rows, key)) for label, rows in runs], (min(steps), max(steps)))
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside upper center", ncols=min(len(runs), 4), frameon=False)
    return fig, keys


def _panel(ax, key: str, lines: list[tuple[str, list[int], list[float]]], span: tuple[int, int]) -> None:
    """One metric. Every panel spans the runs' steps (a metric logged once is a dot at its step,
    not a panel of its own around it); values that agree to a relative 1e-3 are drawn on an axis
    1% wide around them (memory: from 0), their value written in the panel, without an offset
    ("1e-7+3.2435" makes agreeing runs look far apart). Each run has its own dashes and hollow
    marker, each later run's drawn smaller, so identical runs show as nested rings, not one."""
    values = []
    for i, (label, steps, ys) in enumerate(lines):
        if steps:  # dashes per run: runs with equal values (memory, lr) stay visible on top of each other
            # a hollow marker of its own per run, each later run's smaller: equal points stay visible
            # as nested rings (one run's val-loss dot hidden under another's looked like a missing run)
            marker = MARKERS[i % len(MARKERS)] if len(steps) < 30 else None
            ax.plot(steps, ys, marker=marker, fillstyle="none", markersize=max(3.0, 9.0 - 2.0 * i),
                    linewidth=max(1.0, 2.5 - 0.5 * i), label=label, linestyle=LINESTYLES[i % len(LINESTYLES)])
            values += ys
    ax.set_title(PANELS.get(key, f"memory: {key}"))
    ax.set_xlabel("step")
    ax.set_xlim(span[0] - max(1, (span[1] - span[0]) * 0.02), span[1] + max(1, (span[1] - span[0]) * 0.02))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    low, high = min(values), max(values)
    center = (low + high) / 2
    if high - low <= 1e-3 * abs(center):
        # a constant series: memory from 0 (a 1%-wide axis made a flat 3.239 MB look like noise),
        # other metrics 1% wide; either way its value is written in the panel
        half = max(abs(center) * 0.005, 1e-12)
        ax.set_ylim(*((0, max(high * 1.25, 1e-12)) if key.endswith("_mb") else (center - half, center + half)))
        ax.text(0.5, 0.08, f"constant: {center:.4g}" + (" MB" if key.endswith("_mb") else ""),
                transform=ax.transAxes, ha="center", alpha=0.7)
    if key.endswith("_mb"):
        ax.set_ylabel("MB (10^6 bytes)")
    ax.grid(True, alpha=0.3)
    if key == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3), useOffset=False)
    else:
        ax.ticklabel_format(axis="y", useOffset=False)


def main(argv=None) -> int:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description=doc[0], epilog=" ".join(doc[1].split()))
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders holding metrics.jsonl")
    ap.add_argument("--out", default="metrics.png", help="the PNG to write (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        out = Path(args.out)
        if out.suffix.lower() != ".png":
            raise UsageError(f"--out {out} must end in .png; plot.py writes a PNG")
        if not out.parent.is_dir():
            raise UsageError(f"--out {out}: folder {out.parent} does not exist; create it or pick another")
        if out.is_dir():
            raise UsageError(f"--out {out} is a folder; give a file name ending in .png")
        keys = plot([Path(p) for p in args.run_dirs], out)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {', '.join(keys)} of {len(args.run_dirs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
