"""The scripts' command lines: every --help is whole, and plot.py draws the metrics of
real runs into a PNG (bad input: one line, exit 2). The dotted-override hint and the GPU preset
refusal are bad-input cases of tests/test_config.py."""
from __future__ import annotations

import ast
import json
import math
import runpy
import subprocess
import sys

import matplotlib.image
import pytest
import torch

import main as app
import plot
import sample
from testing.local import REPO, TINY, child_env

SCRIPTS = ["main.py", "sample.py", "export.py", "plot.py", *sorted(  # benchmarks/_repo.py is imported, not run
    str(p.relative_to(REPO)) for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))]


def squeeze(text: str) -> str:
    """Text without whitespace: argparse re-wraps (and may break at hyphens) to the terminal width."""
    return "".join(text.split())


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_whole(script, monkeypatch, capsys):
    # the description is the module docstring's first paragraph, which ends a sentence: a help
    # cut at the docstring's first line (mid-sentence) fails here
    doc = ast.get_docstring(ast.parse((REPO / script).read_text(encoding="utf-8")))
    first = doc.split("\n\n")[0]
    assert first.rstrip().endswith((".", ".)", "?", "!")), f"{script}: docstring's first paragraph {first!r}"
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.syspath_prepend(str((REPO / script).parent))  # as python does: the script's folder first
    monkeypatch.delenv("RANK", raising=False)  # memory_per_strategy.py runs its worker under torchrun
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(REPO / script), run_name="__main__")  # exactly `python SCRIPT --help`
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: "), f"{script}: {out[:300]!r}"
    assert squeeze(first) in squeeze(out), f"{script}: --help lacks the whole description {first!r}:\n{out}"


def test_plot_two_real_runs_and_bad_input(tmp_path, capsys):
    runs = [tmp_path / "ddp_run", tmp_path / "other_lr"]
    for run, extra in zip(runs, [[], ["optimizer.lr=3e-3"]]):
        assert app.main(TINY + ["trainer.max_steps=10", "trainer.log_every=2", "trainer.sample_tokens=0",
                                "parallel.strategy=none", f"trainer.run_dir={run}", *extra]) == 0
    capsys.readouterr()
    out = tmp_path / "cmp.png"
    assert plot.main([*map(str, runs), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    # a panel for train loss, val loss, lr, tokens/s and each memory key the runs logged, 2 per row
    logged = {k for run in runs for line in (run / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    memory = sorted(k for k in logged if k.endswith("_mb"))
    assert memory, f"no memory key in {sorted(logged)}"
    panels = ["loss", "val_loss", "lr", "tokens_per_sec", *memory]
    assert said == f"wrote {out}: {', '.join(panels)} of 2 run(s)\n", said
    image = matplotlib.image.imread(out)  # a valid PNG, or this raises
    width = plot.COLUMNS * plot.PANEL_W * plot.DPI
    height = (math.ceil(len(panels) / plot.COLUMNS) * plot.PANEL_H + 0.6) * plot.DPI
    assert image.shape[:2] == (round(height), round(width)) and image.std() > 0.05, image.shape

    # bad input: one line "error: ...", exit 2, the run folders and an existing PNG as they were
    before = {p: p.read_bytes() for run in runs for p in run.rglob("*") if p.is_file()}
    png = out.read_bytes()
    empty, garbled, no_metrics = tmp_path / "empty", tmp_path / "garbled", tmp_path / "no_metrics"
    for d in (empty, garbled, no_metrics):
        d.mkdir()
    (empty / "metrics.jsonl").write_text("")
    rows = (runs[0] / "metrics.jsonl").read_text().splitlines()
    (garbled / "metrics.jsonl").write_text("\n".join([rows[0], rows[1][: len(rows[1]) // 2], *rows[2:]]) + "\n")
    cases = {
        "missing folder": ([str(tmp_path / "nope")], "run folder"),
        "no metrics.jsonl": ([str(no_metrics)], "has no metrics.jsonl"),
        "empty metrics.jsonl": ([str(empty)], "is empty"),
        "a row that does not parse": ([str(garbled)], "line 2 is not a metrics row"),
        "a good run beside a bad one": ([str(runs[0]), str(garbled)], "line 2 is not a metrics row"),
        "not a .png": ([str(runs[0]), "--out", str(tmp_path / "x.pdf")], "must end in .png"),
        "no such out folder": ([str(runs[0]), "--out", str(tmp_path / "no" / "x.png")], "does not exist"),
    }
    for case, (args, words) in cases.items():
        assert plot.main([*args, "--out", str(out)] if "--out" not in args else args) == 2, case
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and words in err, f"{case}: {err!r}"
    assert out.read_bytes() == png
    assert {p: p.read_bytes() for run in runs for p in run.rglob("*") if p.is_file()} == before
    assert json.loads(rows[0])["step"] == 2  # the garbled line above really was a metrics row


def test_plot_axes_show_agreeing_runs_as_agreeing_and_short_series_in_context():
    """Two runs whose val loss agrees to 2e-7 are drawn on an axis 1% wide without offset
    notation (not '1e-7+3.2435', which makes them look far apart); a metric logged once is a
    marked dot on the runs' whole step range, not a panel of its own around that step."""
    rows_a = [{"step": s, "loss": 4.0 - s / 100} for s in range(10, 210, 10)] + [{"step": 200, "val_loss": 3.2435}]
    rows_b = [{"step": s, "loss": 4.0 - s / 100} for s in range(10, 210, 10)] + [{"step": 200, "val_loss": 3.2435002}]
    fig, keys = plot.draw([("a", rows_a), ("b", rows_b)])
    ax = fig.axes[keys.index("val_loss")]
    fig.canvas.draw()
    assert ax.yaxis.get_major_formatter().get_offset() == "", ax.yaxis.get_major_formatter().get_offset()
    low, high = ax.get_ylim()
    assert low < 3.2435 < 3.2435002 < high and 0.01 * 3.2435 * 0.9 < high - low < 0.01 * 3.2435 * 1.1, (low, high)
    left, right = ax.get_xlim()
    assert left <= 10 and right >= 200, (left, right)
    assert ax.lines[0].get_marker() == "o"


def test_plot_identical_runs_both_show_and_a_constant_memory_series_reads_as_constant():
    """Two identical runs: each line has its own marker and the later one is smaller, so the first
    run's val-loss dot is not hidden; a memory series that does not change gets an axis from 0 and
    its value written in the panel, not a 1%-wide axis that looks like noise."""
    rows = [{"step": s, "loss": 4.0 - s / 100, "held_params_mb": 3.239} for s in range(10, 110, 10)] + \
        [{"step": 100, "val_loss": 3.5}]
    fig, keys = plot.draw([("a", rows), ("b", [dict(r) for r in rows])])
    first, second = fig.axes[keys.index("val_loss")].lines
    assert first.get_marker() != second.get_marker() and first.get_markersize() > second.get_markersize()
    assert first.get_fillstyle() == second.get_fillstyle() == "none"  # the one below shows through
    ax = fig.axes[keys.index("held_params_mb")]
    low, high = ax.get_ylim()
    assert low == 0 and high > 3.239 * 1.2, (low, high)
    assert [t.get_text() for t in ax.texts] == ["constant: 3.239 MB"]



def test_sample_generates_a_small_model_with_one_thread(tmp_path, monkeypatch, capsys):
    """Generation at batch 1 gains nothing from threads on a model this small and stalls beside a
    busy core (docs/performance.md#sampling-threads): sample.py sets one thread, unless the user set
    OMP_NUM_THREADS, which wins."""
    run = tmp_path / "run"
    assert app.main(TINY + ["parallel.strategy=none", "trainer.max_steps=1", "trainer.sample_tokens=0",
                            f"trainer.run_dir={run}"]) == 0
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        assert sample.main(["--run-dir", str(run), "--tokens", "5"]) == 0
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        assert sample.main(["--run-dir", str(run), "--tokens", "5"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.launch
def test_a_reader_that_goes_away_ends_main_quietly_with_sigpipes_exit_code(tmp_path):
    """`python main.py ... | head -1`: no BrokenPipeError traceback, exit 128 + SIGPIPE = 141, as the
    shell reports for `yes | head -1`."""
    cmd = [sys.executable, "main.py", *TINY, "parallel.strategy=none", "trainer.max_steps=400", "trainer.log_every=1",
           "trainer.eval_every=0", f"trainer.run_dir={tmp_path / 'run'}"]
    with subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as p:
        first = p.stdout.readline()
        p.stdout.close()  # what head does after its line
        err = p.stderr.read()
        rc = p.wait(timeout=240)
    assert first.startswith("config: "), first
    assert rc == 141 and "Traceback" not in err and "BrokenPipe" not in err, (rc, err[-2000:])


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "presets").glob("*.yaml")))
def test_a_presets_use_line_names_files_a_clone_has_and_its_claim_is_the_readmes(preset):
    """A preset's `# Use:` command names only files a clone has (a path outside the repository,
    such as the tests' ../shared, does not exist for a user), and the speedrun's wall-time claim is
    the README's measured one."""
    text = (REPO / "presets" / preset).read_text(encoding="utf-8")
    use = next(line for line in text.splitlines() if line.startswith("# Use: "))
    for word in use.split()[2:]:
        path = word.split("=", 1)[-1]
        if "/" in path and not path.startswith("<"):
            inside = (REPO / path).resolve().is_relative_to(REPO) and (REPO / path).exists()
            assert inside, f"{preset}: `{use}` names {path}, which a clone does not have"
    if preset == "cpu_speedrun.yaml":
        assert "0.35x" in text and "0.35x" in (REPO / "README.md").read_text(encoding="utf-8")
