"""The step-time model across shapes: strategy_report's 13 layouts at 2 processes over a grid of shapes,
measured median step / predicted step (planner/timing.py on `--hardware local`) per row.

    python benchmarks/step_time_grid.py --out /tmp/grid                  # measure every shape, then compare
    python benchmarks/step_time_grid.py --out /tmp/grid --shapes A,C     # measure only these
    python benchmarks/step_time_grid.py --out /tmp/grid --replan         # compare again, measuring nothing
    python benchmarks/step_time_grid.py --out /tmp/grid3 --median-of /tmp/g1 /tmp/g2 /tmp/g3   # each row's median

Each shape is one torchrun launch of benchmarks/strategy_report.py's worker (the same warm-up, the same
median of REPEATS runs of at least STEPS steps and MIN_RUN_MS ms, barrier to barrier), right after
this machine's figures are calibrated for it (tools/calibrate.py, kept in OUT/calibration-<shape>/:
the machine's speed drifts over a grid's quarter hour); its raw measurement is kept in
OUT/measured-<shape>.json, so that a change to the time model is compared again with `--replan` on the
same measurements instead of timing again. The grid spans width 64-512, depth 2-8, block 32-256; the
global batch shrinks on the largest shapes so that each shape's launch stays within a few minutes on 2
cores. Shapes marked `fit` are those whose ddp, pp and cp-ring rows
chose the form of the compute's element-wise term (a regression of their residuals, docs/planner.md);
its constant, like every local figure, is calibrated by tools/calibrate.py, not fitted on this grid,
and the other shapes are held out. Prints (and writes OUT/grid.md) one table with the CPU's model and instruction sets beside it.

`--median-of` reads grids measured one after the other into their own folders and gives each row
the median of its ratios, each priced by its own grid's calibration: on this shared VM the same row
measures up to 1.4x apart between grids a quarter hour apart, so one grid cannot tell a row the
model misses from a minute the machine was slow; a row whose median is outside the bar is a miss.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import _repo  # noqa: F401  (the repository on sys.path)
import strategy_report as sr
import torch

import planner
from observe.perf import PEAK_CACHE_ENV, cpu_line
from planner.local_hardware import holds_this_machine
from tools.calibrate import measure_local

NPROC = 2
BAR = sr.TIME_BAR


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    width: int
    block: int
    batch: int  # global batch in sequences (a multiple of 4: pp2's 4 micro-batches)
    fit: bool  # a row a fitted constant may be fitted on; the others are held out

    def overrides(self) -> list[str]:
        return [f"model.n_layer={self.layers}", f"model.n_embd={self.width}", "model.n_head=4",
                f"model.block_size={self.block}", "model.dropout=0.0", f"trainer.batch_size={self.batch}"]

    def label(self) -> str:
        return f"{self.layers} x {self.width}, block {self.block}, batch {self.batch}"


# Why these: the two corners measured before (A, E); depth alone at the narrowest width (B: 8 blocks of
# 64, where per-block fixed costs weigh most); the longest block at a narrow width (C: attention's s^2
# against small matmuls); width alone (D, G); a deep model with a short block (F: many tensors, little
# math each); the largest corner (H), its batch cut to 4 so the launch finishes. Fit and held-out shapes
# alternate along the grid's step-time range.
SHAPES = [
    Shape("A", 2, 64, 32, 16, True),
    Shape("B", 8, 64, 64, 16, False),
    Shape("C", 4, 128, 256, 8, True),
    Shape("D", 2, 256, 64, 16, False),
    Shape("E", 4, 256, 128, 16, True),
    Shape("F", 8, 256, 32, 16, False),
    Shape("G", 2, 512, 128, 8, True),
    Shape("H", 6, 512, 256, 4, False),
]


def machine_line() -> str:
    return (f"{cpu_line()} | {len(os.sched_getaffinity(0))} cores; {NPROC} processes x 1 thread, "
            f"torch {torch.__version__}")


def figures(hw) -> str:
    """The local figures the prediction used (they vary between calibrations: say which)."""
    links = [f"{name} {1e3 * link.latency:.2f} ms{f' ({1e3 * link.near_latency:.2f} right after a call)' if link.near_latency else ''} "
             f"+ {link.bandwidth / 1e9:.2f} GB/s"
             for name, link in (("ring step", hw.intra_node), ("all-gather", hw.gather_link),
                                ("reduce-scatter", hw.scatter_link)) if link is not None]
    return (f"figures: {hw.peak('fp32') / 1e9:.1f} GFLOP/s x efficiency {hw.compute_efficiency:.3f}, element-wise "
            f"{hw.elementwise * 1e9:.1f} ns, block {1e3 * hw.block_overhead:.2f} ms, step {1e3 * hw.step_overhead:.2f} ms, "
            f"busy x {hw.busy_node_slowdown:.3f}, split backward {1e3 * hw.split_backward_overhead:.2f} ms + "
            f"{hw.split_backward_elementwise * 1e9:.1f} ns, FSDP2 {1e3 * hw.fsdp_overhead:.2f} ms a block + "
            f"{hw.fsdp_copy * 1e9:.2f} ns a parameter, {1e3 * hw.fsdp_call_latency:.2f} ms a call at least + "
            f"{hw.fsdp_byte_time * 1e9:.2f} ns a byte sent, DTensor AdamW {hw.dtensor_optimizer_overhead * 1e6:.1f} us a tensor, "
            f"ZeRO copies {hw.zero_overhead * 1e6:.1f} us a tensor + {hw.zero_copy * 1e9:.2f} ns an element, "
            f"weight pass {hw.weight_pass * 1e9:.2f} ns a weight element a micro-batch, "
            f"vocabulary-parallel head {1e3 * hw.vocab_overhead:.2f} ms a micro-batch, "
            f"cp ring {1e3 * hw.cp_ring_overhead:.2f} ms + {hw.cp_ring_elementwise * 1e9:.1f} ns, cp allgather "
            f"{1e3 * hw.cp_allgather_overhead:.2f} ms + {hw.cp_allgather_elementwise * 1e9:.1f} ns; "
            f"latency after {1e3 * hw.latency_gap:.1f} ms of compute: "
            + "; ".join(links))


def shape_hardware(out: Path, name: str, calibrate: bool):
    """The local figures calibrated just before this shape was measured (OUT/calibration-<shape>/,
    `calibrate`: measure them now), else the machine's cached ones (a measurement kept from before
    shapes had their own). This shared machine's speed drifts over a grid's 20 minutes (the 8
    calibrations of docs/grid-n2, 2-3 minutes apart: efficiency 0.81-0.995, busy x 1.00-1.12), so
    one calibration made at the start or end of the grid misprices the shapes measured far from
    it."""
    folder = out / f"calibration-{name}"
    if not calibrate and not holds_this_machine(folder / "local-hardware.json"):
        return planner.load_hardware("local", "fp32", measure=measure_local)
    folder.mkdir(exist_ok=True)
    if calibrate:  # measured now, not read from an earlier run into the same folder
        for old in ("local-hardware.json", "peak-flops.json"):
            (folder / old).unlink(missing_ok=True)
    # the folder as the cache: its peak, and local-hardware.json beside it
    with mock.patch.dict(os.environ, {PEAK_CACHE_ENV: str(folder / "peak-flops.json")}):
        return planner.load_hardware("local", "fp32", measure=measure_local)


def rows_of(shape: Shape, measured: dict, hw) -> list[dict]:
    """One row per layout measured at this shape: predicted and measured step, their ratio, the
    prediction's terms."""
    out = []
    for name, got in measured.items():
        rep = sr.compare(name, sr.layouts(NPROC)[name], got, shape.overrides(), NPROC, hw)
        out.append({"shape": shape.name, "layout": name, "predicted_ms": 1000 * rep.step_predicted_s,
                    "measured_ms": 1000 * rep.step_s, "runs_ms": [1000 * x for x in rep.step_runs_s],
                    "ratio": rep.time_ratio, "fit": shape.fit,
                    "terms": {t: 1000 * s for t, s in rep.time_terms}})
    return out


def grid_cell(r: dict) -> str:
    """One grid's row: measured ms / predicted ms = ratio (* outside the bar)."""
    return f"{r['measured_ms']:.1f} / {r['predicted_ms']:.1f} = {r['ratio']:.2f}{'' if abs(r['ratio'] - 1) <= BAR else ' *'}"


def median_cell(r: dict) -> str:
    """A row over several grids: the median ratio (* outside the bar) and the grids' range."""
    return (f"{r['ratio']:.2f}{'' if abs(r['ratio'] - 1) <= BAR else ' *'} "
            f"({min(r['ratios']):.2f}-{max(r['ratios']):.2f})")


def table(rows: list[dict], shapes: list[Shape], cell=grid_cell) -> list[str]:
    """A markdown table: a row per layout, a column per shape, each cell `cell(row)` ("-": not measured)."""
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    by = {(r["shape"], r["layout"]): r for r in rows}
    head = "| layout | " + " | ".join(f"{s.name}: {s.label()}{' (fit)' if s.fit else ''}" for s in shapes) + " |"
    out = [head, "|---" * (len(shapes) + 1) + "|"]
    for name in layouts:
        cells = ["-" if (s.name, name) not in by else cell(by[s.name, name]) for s in shapes]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def summary(rows: list[dict]) -> list[str]:
    out = []
    for label, pick in (("fit", True), ("held out", False)):
        sub = [r for r in rows if r["fit"] is pick]
        if not sub:
            continue
        outside = [r for r in sub if abs(r["ratio"] - 1) > BAR]
        out.append(f"{label}: {len(sub)} rows, {len(outside)} outside {BAR:.0%}, median ratio "
                   f"{statistics.median(r['ratio'] for r in sub):.2f}, range {min(r['ratio'] for r in sub):.2f}-"
                   f"{max(r['ratio'] for r in sub):.2f}")
    worst = sorted(rows, key=lambda r: -abs(r["ratio"] - 1))[:8]
    out.append("worst: " + "; ".join(f"{r['shape']} {r['layout']} {r['ratio']:.2f}" for r in worst))
    return out


def main() -> None:
    if "RANK" in os.environ:
        sys.exit("error: run step_time_grid.py from a shell; it launches strategy_report.py's workers itself")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for measured-<shape>.json, grid.json and grid.md")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per run (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per layout, the median counts (default 3)")
    ap.add_argument("--min-run-ms", type=float, default=sr.MIN_RUN_MS,
                    help=f"each timed run lasts at least this long (default {sr.MIN_RUN_MS:g})")
    ap.add_argument("--shapes", default="", help=f"comma-separated shape names (default all: "
                    f"{','.join(s.name for s in SHAPES)})")
    ap.add_argument("--replan", action="store_true", help="measure nothing: compare the kept measurements again")
    ap.add_argument("--median-of", nargs="+", metavar="GRID", default=[],
                    help="measure nothing: each row's median ratio over the grids measured into these folders "
                         "(each priced by its own calibrations), written to OUT/grid.md")
    args = ap.parse_args()
    known = {s.name: s for s in SHAPES}
    names = [x.strip() for x in args.shapes.split(",") if x.strip()] or list(known)
    if unknown := [x for x in names if x not in known]:
        ap.exit(2, f"error: unknown shape(s) {unknown}; choose from {sorted(known)}\n")
    if args.steps < 1 or args.repeats < 1 or args.min_run_ms < 0:
        ap.exit(2, "error: --steps and --repeats must be >= 1, --min-run-ms >= 0\n")
    if args.median_of and len({Path(d).resolve() for d in args.median_of}) < 2:
        ap.exit(2, "error: --median-of needs at least two different grid folders\n")
    if missing := [d for d in args.median_of if not any(Path(d).glob("measured-*.json"))]:
        ap.exit(2, f"error: no measured-<shape>.json in {', '.join(missing)}; measure each grid first "
                   f"(step_time_grid.py --out FOLDER)\n")
    if any(Path(d).resolve() == Path(args.out).resolve() for d in args.median_of):
        ap.exit(2, f"error: --out {args.out} is one of the --median-of grids, whose grid.md it would replace; "
                   f"give another folder\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(machine_line(), flush=True)
    for name in names if not (args.replan or args.median_of) else []:
        shape = known[name]
        cases, _ = sr.fitting(sr.layouts(NPROC), shape.overrides(), NPROC)
        print(f"calibrating, then measuring {name}: {shape.label()}, {len(cases)} layouts", flush=True)
        shape_hardware(out, name, calibrate=True)
        measured = sr.measure(cases, shape.overrides(), NPROC, args.steps, args.repeats, args.min_run_ms)
        (out / f"measured-{name}.json").write_text(json.dumps(measured))
        (out / f"timing-{name}.json").write_text(json.dumps({"steps": args.steps, "repeats": args.repeats,
                                                             "min_run_ms": args.min_run_ms}))
    if args.median_of:
        return write_median(out, [Path(d) for d in args.median_of], [known[n] for n in names])
    shapes, hws, rows = replan(out, [known[n] for n in names])
    if not shapes:
        ap.exit(2, f"error: no measured-<shape>.json in {out}; run without --replan first\n")
    timing = {json.dumps(json.loads(p.read_text())) for p in out.glob("timing-*.json")}
    lines = [machine_line(), *[f"{name}: hardware: {hw.source}; {figures(hw)}" for name, hw in hws.items()], "",
             f"Cells: measured ms / predicted ms = measured / predicted (* outside {BAR:.0%}); the median "
             f"of REPEATS runs of at least STEPS steps and MIN_RUN_MS ms: {', '.join(sorted(timing))}.", ""]
    lines += table(rows, shapes) + [""] + summary(rows)
    (out / "grid.json").write_text(json.dumps({"cpu": machine_line(), "hardware": {n: hw.source for n, hw in hws.items()},
                                               "rows": rows}, indent=1))
    (out / "grid.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def replan(out: Path, wanted: list[Shape]) -> tuple[list[Shape], dict, list[dict]]:
    """The shapes of `wanted` measured in `out`, their hardware (each its own calibration) and rows."""
    torch.set_num_threads(1)  # the prediction's `local` hardware: one thread per rank, as measured
    shapes = [s for s in wanted if (out / f"measured-{s.name}.json").is_file()]
    hws = {s.name: shape_hardware(out, s.name, calibrate=False) for s in shapes}
    rows = [r for s in shapes
            for r in rows_of(s, json.loads((out / f"measured-{s.name}.json").read_text()), hws[s.name])]
    return shapes, hws, rows


def median_rows(grids: list[list[dict]]) -> list[dict]:
    """One row per (shape, layout) measured in every grid: the median of its ratios (each grid's row
    priced by that grid's own calibration), their range, and the medians of the measured and
    predicted steps. A row measured in only some grids is left out: its median would weigh fewer
    passes."""
    by: dict[tuple[str, str], list[dict]] = {}
    for rows in grids:
        for r in rows:
            by.setdefault((r["shape"], r["layout"]), []).append(r)
    out = []
    for (shape, layout), rs in by.items():
        if len(rs) < len(grids):
            continue
        out.append({"shape": shape, "layout": layout, "fit": rs[0]["fit"],
                    "ratio": statistics.median(r["ratio"] for r in rs), "ratios": [r["ratio"] for r in rs],
                    "measured_ms": statistics.median(r["measured_ms"] for r in rs),
                    "predicted_ms": statistics.median(r["predicted_ms"] for r in rs)})
    return out


def median_table(rows: list[dict], shapes: list[Shape]) -> list[str]:
    return table(rows, shapes, median_cell)


def write_median(out: Path, folders: list[Path], wanted: list[Shape]) -> None:
    """OUT/grid.md and grid.json: each row's median ratio over the grids measured into `folders`
    (each an --out of its own run, priced by its own calibrations), beside each grid's own count."""
    per_grid = [replan(f, wanted) for f in folders]
    shapes = [s for s in wanted if all(s in got[0] for got in per_grid)]
    if not shapes:
        sys.exit(f"error: no shape of {', '.join(s.name for s in wanted)} was measured in every grid; "
                 f"give grids that share shapes, or --shapes to choose them")
    rows = median_rows([[r for r in got[2] if r["shape"] in {s.name for s in shapes}] for got in per_grid])
    lines = [machine_line(), "", f"Cells: the median of measured / predicted over {len(folders)} grids, each row "
             f"priced by its own grid's calibration of that shape (* the median outside {BAR:.0%}), and the "
             f"range over the grids.", ""]
    for f, (_, hws, grid_rows) in zip(folders, per_grid):
        inside = [r for r in grid_rows if r["shape"] in {s.name for s in shapes}]
        lines.append(f"- {f}: {sum(abs(r['ratio'] - 1) > BAR for r in inside)} of {len(inside)} rows outside {BAR:.0%}")
        lines += [f"  - {name}: {hw.source}" for name, hw in hws.items() if name in {s.name for s in shapes}]
    lines += ["", *median_table(rows, shapes), "", *summary(rows)]
    (out / "grid.json").write_text(json.dumps({"cpu": machine_line(), "grids": [str(f) for f in folders],
                                               "rows": rows}, indent=1))
    (out / "grid.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
