"""The application end to end: `python main.py` trains and writes
config.yaml, metrics.jsonl, snapshots, model.pt and sample.txt; sample.py and export.py read
them; the LR schedule, max_epochs, fp16/bf16 steps, and a bit-exact resume with dropout on.

One real `python main.py` and one real `python sample.py`; everything else runs in-process
(`main.main([...])`), which costs milliseconds instead of seconds of imports."""
from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import export
import main as app
import sample
from checks import load_config
from launch.errors import OneLineErrors
from launch.schedule import lr_at, total_steps
from parallel import env as penv
from parallel.env import init_distributed
from testing.local import CORPUS, DEVICE, TINY, python


def model_pt(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


@pytest.mark.launch
def test_python_main_py_trains_and_writes_every_output(tmp_path, capsys):
    run = tmp_path / "run"
    r = python(["main.py", *TINY, "trainer.max_steps=10", "trainer.save_every=5", f"trainer.run_dir={run}"],
               timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: step 10 | val loss" in r.stdout and "--- sample ---" in r.stdout

    # config.yaml: the resolved config, loadable as a config file
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["trainer"]["max_steps"] == 10 and resolved["model"]["n_embd"] == 32
    assert load_config(str(run / "config.yaml")).to_dict() == resolved

    # metrics.jsonl: a row per log step (every 5), eval rows carry val_loss
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [5, 10]
    cfg = load_config(None, TINY + ["trainer.max_steps=10"])
    for row in train_rows:
        assert {"step", "loss", "lr", "tokens_per_sec", "mfu"} <= row.keys()
        assert math.isfinite(row["loss"]) and row["tokens_per_sec"] > 0
        # a cuda session runs fp32 without TF32 (NVIDIA_TF32_OVERRIDE=0), whose peak is unknown: MFU 0
        assert row["mfu"] > 0 if DEVICE == "cpu" else row["mfu"] == 0
        assert row["lr"] == pytest.approx(lr_at(row["step"] - 1, cfg, 10))  # lr of the step just done
    assert [r["step"] for r in rows if "val_loss" in r] == [5, 10]
    assert all(math.isfinite(r["val_loss"]) for r in rows if "val_loss" in r)

    # snapshots every 5 steps (keep 2), and model.pt with plain tensors only
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == ["step_0000005", "step_0000010"]
    payload = model_pt(run)
    assert payload["step"] == 10 and payload["tokenizer"]["kind"] == "char"
    assert payload["model_config"]["n_embd"] == 32 and "blocks.3.mlp.fc.weight" in payload["model"]
    assert len((run / "sample.txt").read_text()) > 20

    # sample.py from model.pt, as a user runs it
    r = python(["sample.py", "--run-dir", str(run), "--prompt", "ROMEO:", "--tokens", "50"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout.rstrip("\n")) == len("ROMEO:") + 50
    # a prompt that is not UTF-8 (real bytes in argv; Python hands them over as surrogates)
    r = python(["sample.py", "--run-dir", str(run), "--prompt", os.fsdecode(b"RO\xffMEO")], timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: --prompt"), r.stderr

    # sample.py --snapshot and export.py (in-process): the newest snapshot is the final model
    capsys.readouterr()
    assert sample.main(["--run-dir", str(run), "--snapshot", "--prompt", "ROMEO:", "--tokens", "50",
                        "--temperature", "0"]) == 0
    from_snapshot = capsys.readouterr().out
    assert sample.main(["--run-dir", str(run), "--prompt", "ROMEO:", "--tokens", "50", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == from_snapshot  # same weights, greedy: same text
    assert export.main(["--run-dir", str(run), "--step", "10", "--out", str(tmp_path / "x.pt")]) == 0
    exported = torch.load(tmp_path / "x.pt", weights_only=True)
    assert exported["model"].keys() == payload["model"].keys()
    assert all(torch.equal(exported["model"][k], v) for k, v in payload["model"].items())
    # bad sample.py input: one line, exit 2
    assert sample.main(["--run-dir", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    # export.py --step N without such a snapshot: one line listing the steps there are (or none)
    assert export.main(["--run-dir", str(run), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no snapshot at step 7" in err and "it has steps 5, 10:" in err, err
    assert export.main(["--run-dir", str(tmp_path / "nothing"), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "there are none" in err, err


def test_lr_schedule_warmup_cosine_and_floor():
    cfg = load_config(None, ["optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "optimizer.warmup_steps=100"])
    assert lr_at(0, cfg, 2000) == pytest.approx(1e-5)  # linear warmup from lr / warmup_steps
    assert lr_at(49, cfg, 2000) == pytest.approx(5e-4)
    assert lr_at(99, cfg, 2000) == pytest.approx(1e-3)
    assert lr_at(100, cfg, 2000) == pytest.approx(1e-3)  # cosine starts at the peak
    assert lr_at(1050, cfg, 2000) == pytest.approx(5.5e-4)  # half-way: (lr + min_lr) / 2
    assert lr_at(1999, cfg, 2000) == pytest.approx(1e-4, rel=1e-3)
    assert lr_at(2000, cfg, 2000) == lr_at(5000, cfg, 2000) == 1e-4  # the floor after the decay
    lengths = load_config(None, ["optimizer.lr_decay_steps=500"])
    assert lr_at(300, lengths, 2000) == pytest.approx(5.5e-4) and lr_at(600, lengths, 2000) == 1e-4
    no_warmup = load_config(None, ["optimizer.warmup_steps=0"])
    assert lr_at(0, no_warmup, 100) == pytest.approx(1e-3)


def test_max_epochs_is_converted_to_steps(tmp_path):
    from char_dataset import CharDataset
    from corpus.text import load_corpus
    from corpus.tokenizers import CharTokenizer
    cfg = load_config(None, TINY + ["trainer.max_epochs=0.002", "trainer.max_steps=999"])
    text, _ = load_corpus(cfg.data)
    data = CharDataset(CharTokenizer.from_corpus(text).encode(text), 16, 0.1, 0)
    per_epoch = data.steps_per_epoch(8)
    assert per_epoch == 1406  # (180000 train tokens - 16) // 16 windows // batch 8
    assert total_steps(cfg, data) == math.ceil(0.002 * per_epoch) == 3
    assert total_steps(load_config(None, TINY + ["trainer.max_steps=7"]), data) == 7
    assert total_steps(load_config(None, TINY + ["trainer.max_epochs=2"]), data) == 2 * per_epoch
    assert app.main(TINY + ["trainer.max_epochs=0.002", "trainer.sample_tokens=0",
                            f"trainer.run_dir={tmp_path / 'run'}"]) == 0
    assert model_pt(tmp_path / "run")["step"] == 3


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_steps_run_and_stay_finite(precision, tmp_path):
    from launch.build import build_trainer
    losses = {}
    for prec in ("fp32", precision):
        cfg = load_config(None, TINY + [f"trainer.precision={prec}", "parallel.strategy=none",
                                        f"trainer.run_dir={tmp_path / prec}"])
        torch.manual_seed(0)
        trainer = build_trainer(cfg, init_distributed(cfg), tmp_path / prec)
        assert (trainer.scaler is not None) == (prec == "fp16")  # loss scaling for fp16 only
        losses[prec] = []
        for _ in range(4):
            loss, norm = trainer.train_step()
            assert math.isfinite(float(loss)) and math.isfinite(float(norm)), (prec, loss, norm)
            losses[prec].append(float(loss))
        assert all(torch.isfinite(p).all() for p in trainer.strategy.unwrapped()[0].parameters())
    # same data and init: the half-precision loss tracks the fp32 one
    for a, b in zip(losses["fp32"], losses[precision]):
        assert abs(a - b) < 0.05 * a, (losses["fp32"], losses[precision])


def test_resume_with_dropout_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    # dropout draws random numbers every step: a resume must restore the RNG state too
    # (tests/test_snapshots.py covers the dropout-free case and the keep/damage rules)
    common = TINY + ["model.dropout=0.1", "parallel.strategy=none", "trainer.save_every=3",
                     "trainer.sample_tokens=0", "optimizer.lr_decay_steps=9"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert app.main(common + ["trainer.max_steps=9", f"trainer.run_dir={full}"]) == 0
    assert app.main(common + ["trainer.max_steps=6", f"trainer.run_dir={cut}"]) == 0
    assert app.main(common + ["trainer.max_steps=9", f"trainer.run_dir={cut}"]) == 0
    a, b = model_pt(full)["model"], model_pt(cut)["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs by {(a[k] - b[k]).abs().max().item():.3e}"
    # and the dropout really was on: a run without it ends elsewhere
    assert app.main(TINY + ["parallel.strategy=none", "trainer.max_steps=9", "trainer.sample_tokens=0",
                            "optimizer.lr_decay_steps=9", f"trainer.run_dir={tmp_path / 'nodrop'}"]) == 0
    assert not torch.equal(model_pt(tmp_path / "nodrop")["model"]["lm_head.weight"], a["lm_head.weight"])


def test_corpus_without_newlines_and_a_failing_output_after_training(tmp_path, capsys):
    """The end-of-run sample used to start from "\n": with a corpus that has none, a finished run
    exited 2. Now it starts from a token of the vocabulary; and whatever fails after training (here
    sample.txt cannot be written: a folder is in its place) is one warning, the run exits 0."""
    one_line = tmp_path / "one_line.txt"
    one_line.write_text(CORPUS.read_text(encoding="utf-8")[:100_000].replace("\n", " "), encoding="utf-8")
    run = tmp_path / "run"
    assert app.main(TINY + [f"data.path={one_line}", "trainer.max_steps=2", f"trainer.run_dir={run}"]) == 0
    assert "\n" not in json.loads((run / "tokenizer.json").read_text(encoding="utf-8"))["chars"]
    assert len((run / "sample.txt").read_text(encoding="utf-8")) == 1 + 20  # start token + sample_tokens
    capsys.readouterr()
    assert sample.main(["--run-dir", str(run), "--tokens", "5"]) == 0  # sample.py's default prompt too
    assert len(capsys.readouterr().out.rstrip("\n")) == 1 + 5

    blocked = tmp_path / "blocked"
    (blocked / "sample.txt").mkdir(parents=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert app.main(TINY + ["trainer.max_steps=2", f"trainer.run_dir={blocked}"]) == 0
    ours = [str(w.message) for w in caught if "sample" in str(w.message)]
    assert len(ours) == 1 and "\n" not in ours[0] and "IsADirectoryError" in ours[0], ours
    assert "done: step 2" in capsys.readouterr().out and (blocked / "model.pt").is_file()


def test_eval_every_0_turns_evaluation_off(tmp_path, capsys):
    """trainer.eval_every=0: no evaluation at any step, the end included; the run still finishes
    and says that its loss was not evaluated."""
    run = tmp_path / "run"
    assert app.main(TINY + ["parallel.strategy=none", "trainer.max_steps=4", "trainer.log_every=2",
                            "trainer.eval_every=0", "trainer.sample_tokens=0", f"trainer.run_dir={run}"]) == 0
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and not any("val_loss" in r for r in rows), rows
    out = capsys.readouterr().out
    assert "val loss not evaluated (trainer.eval_every=0)" in out and "step 4: val loss" not in out, out


@pytest.mark.parametrize("overrides, note", [
    (["trainer.max_steps=4", "optimizer.warmup_steps=10"],
     "note: optimizer.warmup_steps=10 is not shorter than the run (4 steps): the LR ends at 4.000e-04 and never "
     "reaches optimizer.lr=0.001"),
    (["trainer.max_steps=4", "optimizer.lr_decay_steps=8"],
     "note: optimizer.lr_decay_steps=8 is longer than the run (4 steps): the LR ends at"),
])
def test_a_schedule_the_run_never_completes_is_noted_at_start_up(overrides, note, tmp_path, capsys):
    """A warmup or a cosine longer than the run never reaches optimizer.lr or optimizer.min_lr:
    the start-up view says so in one line, with the LR the run really ends at."""
    run = tmp_path / "run"
    assert app.main(TINY + ["parallel.strategy=none", "trainer.sample_tokens=0", "optimizer.lr=1e-3",
                            f"trainer.run_dir={run}", *overrides]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("note:")]
    assert len(lines) == 1 and lines[0].startswith(note), lines
    if "warmup" in note:
        rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        assert max(r["lr"] for r in rows if "lr" in r) < 1e-3


def test_a_warmup_as_long_as_the_run_reaches_the_lr_at_the_last_step_and_the_note_says_so(tmp_path, capsys):
    """At the boundary (warmup_steps = max_steps) the last step runs at optimizer.lr: the note must not
    say it is never reached (metrics.jsonl shows it), but that the run never decays."""
    run = tmp_path / "run"
    assert app.main(TINY + ["parallel.strategy=none", "trainer.sample_tokens=0", "optimizer.lr=1e-3",
                            "trainer.max_steps=4", "optimizer.warmup_steps=4", "trainer.log_every=1",
                            f"trainer.run_dir={run}"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("note:")]
    assert lines == ["note: optimizer.warmup_steps=4 is the whole run (4 steps): the LR reaches optimizer.lr=0.001 "
                     "only at the last step and never decays; lower optimizer.warmup_steps (e.g. 1)"], lines
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if r.get("step") == 4 and "lr" in r] == [pytest.approx(1e-3)], rows


@pytest.mark.parametrize("setting", ["lean", "reuse"])
def test_host_memory_reuse_wraps_the_training_loop_only(setting, tmp_path, monkeypatch, capsys):
    """trainer.host_memory reaches observe/host_memory.py's reuse_step_memory as launch/app.py
    enters it: enabled only for `reuse`, entered after the run's first files are written (the model
    was built and loaded lean) and left after the last step's snapshot, before model.pt is written
    (the export runs lean). tests/test_host_memory.py shows what the setting does to the heap."""
    import launch.app
    seen = []

    @contextlib.contextmanager
    def recorder(enabled: bool = True):
        seen.append(("enter", enabled, (run / "config.yaml").exists(), sorted(snapshot_names(run))))
        yield
        seen.append(("exit", enabled, (run / "model.pt").exists(), sorted(snapshot_names(run))))
    monkeypatch.setattr(launch.app, "reuse_step_memory", recorder)
    run = tmp_path / "run"
    assert app.main([*TINY, "trainer.max_steps=2", "trainer.sample_tokens=0", f"trainer.host_memory={setting}",
                     f"trainer.run_dir={run}"]) == 0
    on = setting == "reuse"
    assert seen == [("enter", on, True, []), ("exit", on, False, ["step_0000002"])], seen
    assert (run / "model.pt").exists()


def snapshot_names(run: Path) -> list[str]:
    return [p.name for p in (run / "snapshots").iterdir()] if (run / "snapshots").exists() else []


def dies_halfway(obj, f):
    """json.dump that writes part of the record, then the process stops (a kill mid-write)."""
    f.write('{"message": ')
    f.flush()
    raise KeyboardInterrupt


def test_the_error_file_for_torchrun_is_whole_or_absent_when_its_writer_dies(tmp_path, monkeypatch):
    """torchrun's agent reads a dead worker's TORCHELASTIC_ERROR_FILE and crashed with a
    JSONDecodeError on an empty one (a worker killed while writing it: seen once in CI's random
    kills). A write cut off halfway leaves no file behind; a finished one is valid JSON naming the line."""
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setattr(penv.json, "dump", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        penv.write_error_file("error: boom")
    assert not path.exists()
    monkeypatch.undo()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    penv.write_error_file("error: boom")
    assert json.loads(path.read_text())["message"]["message"] == "error: boom"


def test_a_bugs_traceback_in_the_error_file_is_whole_or_absent_when_its_writer_dies(tmp_path, monkeypatch):
    """The same for an exception that is a bug (torch's own record, which keeps the traceback): a
    write cut off halfway leaves no file; a finished one names the exception and holds its traceback."""
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise RuntimeError("a bug")
    except RuntimeError as e:
        with monkeypatch.context() as m:
            m.setattr(json, "dump", dies_halfway)
            with pytest.raises(KeyboardInterrupt):
                OneLineErrors().record_exception(e)
        assert not path.exists()
        OneLineErrors().record_exception(e)
    message = json.loads(path.read_text())["message"]
    assert message["message"] == "RuntimeError: a bug"
    assert 'raise RuntimeError("a bug")' in message["extraInfo"]["py_callstack"]
