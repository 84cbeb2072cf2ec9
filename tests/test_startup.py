"""What a launch prints before it trains: nothing but the error line for bad input (torchrun's
failure summary included), a short start-up view, the whole config only with --print-config, and
a layout description that names what runs on each mesh dimension.

Launches: one 2-process torchrun of main.py that refuses its layout; the rest runs in this process."""
import re

import pytest

import main as app
from checks import load_config
from config import dump_yaml
from harness import SHOWN_DEVICE
from parallel.env import DistEnv
from parallel.registry import build_strategy
from testing.local import TINY, torchrun


def describe(world: int, overrides: list[str]) -> str:
    cfg = load_config(None, TINY + overrides)
    return build_strategy(cfg, DistEnv(world_size=world)).describe()


def test_layout_description_names_the_strategy_of_each_dimension():
    # parallel.strategy acts on dp only: a tp=2 or pp=2 run with dp = 1 is not a "ddp" run
    tp = describe(2, ["parallel.strategy=ddp", "parallel.tp=2"])
    assert tp.startswith("pp 1 x dp 1 x tp 2 (megatron") and "ddp" not in tp, tp
    pp = describe(2, ["parallel.strategy=ddp", "parallel.pp=2"])
    assert pp.startswith("pp 2 (1f1b, ") and pp.endswith(" x dp 1 x tp 1") and "ddp" not in pp, pp
    mesh = describe(8, ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"])
    assert re.fullmatch(r"pp 2 \(1f1b, \d+ micro-batches\) x dp 2 \(fsdp \(FSDP2.*\)\) x tp 2 \(megatron.*, "
                        r"sequence parallel\)", mesh), mesh
    assert describe(2, ["parallel.strategy=ddp"]).startswith("pp 1 x dp 2 (ddp (bucket ")
    assert describe(1, ["parallel.strategy=none"]) == "none (one process, no parallelism)"


def test_bad_layout_prints_nothing_before_its_error_line(tmp_path, capsys):
    # a layout error found when the strategy is built (pp=2 needs 2 processes), after the config loaded
    assert app.main(TINY + ["parallel.pp=2", f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: world size 1 ") and out.err.count("\n") == 1, out
    assert not (tmp_path / "run").exists()


def test_startup_view_is_short_and_the_whole_config_is_on_request(tmp_path, capsys):
    run = tmp_path / "run"
    common = TINY + ["parallel.strategy=none", "trainer.sample_tokens=0", f"trainer.run_dir={run}"]
    assert app.main(common + ["trainer.max_steps=1"]) == 0
    out = capsys.readouterr().out
    head = out[:out.index("\nrun: ")]
    view = out[:out.index("\n", len(head) + 1)].splitlines()
    assert len(view) == 4 and view[0].startswith("config: ") and "trainer.max_steps=1" in view[0], view
    assert view[1] == f"layout: world 1 = none (one process, no parallelism) | device {SHOWN_DEVICE}", view
    assert "data: " in view[2] and view[3].startswith("run: 1 steps of 8 x 16 = 128 tokens | from step 0 |"), view
    assert "optimizer:" not in out  # no YAML dump
    # --print-config: the YAML that config.yaml holds, then the same view (here: a resume)
    assert app.main(["--print-config"] + common + ["trainer.max_steps=2"]) == 0
    out = capsys.readouterr().out
    written = (run / "config.yaml").read_text(encoding="utf-8")
    assert written == dump_yaml(load_config(None, common + ["trainer.max_steps=2"]))
    assert out.startswith(written + "config: "), out[:3000]
    assert f"| resumed from {run / 'snapshots' / 'step_0000001'} at step 1 |" in out, out[:3000]


@pytest.mark.launch
def test_layout_error_under_torchrun_is_the_last_line_and_in_the_summary(tmp_path):
    run = tmp_path / "run"
    r = torchrun(2, ["main.py", *TINY, "parallel.tp=4", f"trainer.run_dir={run}"], timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]  # torchrun's own exit code when a worker fails
    line = "error: world size 2 is not divisible by parallel.tp * parallel.pp = 4; launch a multiple of 4 processes"
    assert r.stdout == "", r.stdout[-2000:]
    # the project's output ends before torchrun's first log line (W/E + date): it is the one line
    err = r.stderr.splitlines()
    first_agent = next(i for i, s in enumerate(err) if re.match(r"[WEI]\d{4} ", s))
    assert err[:first_agent] == [line], r.stderr[-3000:]
    # torchrun's summary shows it as the root cause (rank 0), instead of "To enable traceback see"
    root = r.stderr[r.stderr.index("Root Cause"):]
    assert "rank      : 0 " in root and f"traceback : {line}\n" in root, r.stderr[-3000:]
    assert r.stderr.count(line) == 2 and "To enable traceback" not in r.stderr, r.stderr[-3000:]
    # what the README says: the summary's copy is among the last lines, and `grep '^error:'` on
    # torchrun's stderr finds the one line
    assert any(s.endswith(f"traceback : {line}") for s in err[-8:]), err[-12:]
    assert [s for s in err if s.startswith("error:")] == [line]
    assert not run.exists()
