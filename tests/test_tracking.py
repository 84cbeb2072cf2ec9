"""Run tracking: metrics.jsonl, wandb offline files, resume of the same wandb run, one
wandb run per multi-process run, a broken wandb that does not stop training, no secret in the
run folder, the wandb.* config keys, and the progress view (terminal bar and plain lines); the wandb run of
a newline-free corpus is finished, and a data.path URL's password and token are
in no file and no output line.

No test touches the network: wandb runs offline, the "broken wandb" case points online mode
at a closed local port (WANDB_BASE_URL=http://127.0.0.1:9) with a short MINGPT_WANDB_TIMEOUT, and
the corpus behind credentials comes from an http.server on 127.0.0.1.
wandb 0.31 writes no history/config/summary files offline, only the `.wandb` transaction log
(leveldb log format of `wandb_internal_pb2.Record` protobufs) and no Python reader for it, so
`wandb_records` below decodes that log with wandb's own protobuf classes.
"""
from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import shutil
import struct
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import yaml

from harness import metric_steps
from testing.local import CORPUS, REPO, TINY, child_env, torchrun

FAKE_KEY = "fakekey0SECRET0" + "0123456789abcdef" * 2  # 47 characters: never a real key
METRIC_KEYS = {"loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "step_time_ms", "rss_peak_mb",
               "held_params_mb", "held_grads_mb", "held_optim_mb"}


# ----------------------------------------------------------------------------- helpers


def wandb_records(path: Path):
    """Yield the protobuf Records of a `.wandb` file: a 7-byte header (':W&B', magic, version),
    then 32 KiB blocks of chunks with a 7-byte header (crc32c u32, length u16, type u8:
    1 full, 2 first, 3 middle, 4 last); a block tail shorter than 7 bytes is zero padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero-filled rest of a block
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb_run(run_folder: Path) -> dict:
    """run record fields, history rows {key: value} (with '_step'), merged config and summary."""
    (log,) = run_folder.glob("run-*.wandb")
    out = {"run": None, "history": [], "config": {}, "summary": {}}
    key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731
    for r in wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = r.run
            out["config"].update({key(i): json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            out["history"].append({key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            out["summary"].update({key(i): json.loads(i.value_json) for i in r.summary.update})
    return out


def main_env(tmp_path: Path, **extra) -> dict:
    """testing.local.child_env plus wandb's own folders kept inside the test's tmp_path."""
    home = tmp_path / "wandb-home"
    return child_env(WANDB_CONFIG_DIR=home / "config", WANDB_CACHE_DIR=home / "cache",
                     WANDB_DATA_DIR=home / "data", WANDB_ARTIFACT_DIR=home / "artifacts", **extra)


def run_main(args: list[str], env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "main.py", *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def assert_no_secret(run_dir: Path, *outputs: str) -> None:
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), f"API key written into {path}"
    for text in outputs:
        assert FAKE_KEY not in text, "API key printed"


def snapshot_meta(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "snapshots" / f"step_{step:07d}" / "meta.json").read_text())


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


# ----------------------------------------------------------------------------- single process


@pytest.mark.launch
def test_offline_run_logs_everything_and_resume_continues_the_same_run(tmp_path):
    """Launch 1: 10 steps, snapshots at 5 and 10. Then the step-10 snapshot is deleted: the same
    state as a crash after step 10 was logged but before it was saved. Launch 2 (15 steps)
    resumes at 5, recomputes 6..15 and must log to wandb only step 15, under the same run id."""
    run_dir = tmp_path / "run"
    args = TINY + [f"trainer.run_dir={run_dir}", "parallel.strategy=none", "wandb.enabled=true",
                   "trainer.save_every=5", "wandb.group=g1", "wandb.tags=t1,t2"]
    # WANDB_MODE=offline from the environment beats the API key (`WANDB_MODE=offline torchrun ...`)
    env = main_env(tmp_path, WANDB_API_KEY=FAKE_KEY)
    first = run_main(args + ["trainer.max_steps=10"], env)

    (run_a,) = offline_runs(run_dir)
    a = read_wandb_run(run_a)
    run_id = json.loads((run_dir / "tracker.json").read_text())["run_id"]
    assert a["run"].run_id == run_id == snapshot_meta(run_dir, 10)["tracker_run_id"]
    assert list(a["run"].tags) == ["t1", "t2"] and a["run"].display_name == "run"
    rows = [h for h in a["history"] if "loss" in h]
    assert [h["_step"] for h in rows] == [5, 10]
    for h in rows:
        assert METRIC_KEYS | {"val_loss"} <= set(h), sorted(h)
    assert a["config"]["trainer"]["max_steps"] == 10 and a["config"]["model"]["n_embd"] == 32
    assert a["config"]["wandb"]["group"] == "g1"
    assert a["summary"]["final_step"] == 10 and "sample_text" in a["summary"]
    assert any(k.startswith("sample/") for h in a["history"] for k in h), "no sample panel"
    assert metric_steps(run_dir) == [5, 10]
    assert f"wandb: offline run {run_id}: {run_a}" in first.stdout
    # plain progress lines (stderr is a pipe here, not a terminal): one per log step, no \r
    lines = [ln for ln in first.stderr.splitlines() if ln.startswith("step ") and "tok/s" in ln]
    assert [ln.split()[1] for ln in lines] == ["5/10", "10/10"], first.stderr[-2000:]
    assert "\r" not in first.stderr and "eta" in lines[-1] and "mfu" in lines[-1]

    shutil.rmtree(run_dir / "snapshots" / "step_0000010")
    second = run_main(args + ["trainer.max_steps=15"], env)
    assert "resumed from" in second.stdout
    assert f"wandb: offline run {run_id}, continuing after step 10: " in second.stdout
    runs = offline_runs(run_dir)
    assert len(runs) == 2 and runs[0] == run_a
    b = read_wandb_run(runs[1])
    assert b["run"].run_id == run_id == snapshot_meta(run_dir, 15)["tracker_run_id"]
    assert [h["_step"] for h in b["history"] if "loss" in h] == [15], "step 10 logged twice"
    assert b["config"]["trainer"]["max_steps"] == 15
    assert metric_steps(run_dir) == [5, 10, 15]  # the crashed launch's row 10 was replaced
    assert json.loads((run_dir / "tracker.json").read_text()) == {"run_id": run_id, "last_logged_step": 15}
    assert_no_secret(run_dir, first.stdout, first.stderr, second.stdout, second.stderr)


@pytest.mark.launch
def test_unreachable_wandb_does_not_stop_training(tmp_path):
    """No wandb.mode and no WANDB_MODE, but an API key: online, against a closed local port."""
    run_dir = tmp_path / "run"
    env = main_env(tmp_path, WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL="http://127.0.0.1:9",
                   MINGPT_WANDB_TIMEOUT="3")
    env.pop("WANDB_MODE")
    r = run_main(TINY + [f"trainer.run_dir={run_dir}", "parallel.strategy=none", "wandb.enabled=true",
                         "trainer.max_steps=5"], env)
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: wandb")]
    assert len(ours) == 1 and "init failed" in ours[0] and "training goes on" in ours[0], r.stderr
    assert metric_steps(run_dir) == [5] and (run_dir / "model.pt").is_file()
    assert "done: step 5" in r.stdout
    assert_no_secret(run_dir, r.stdout, r.stderr)


# ----------------------------------------------------------------------------- two processes


SECRET_PASSWORD, SECRET_TOKEN = "pw0SECRET0pass", "tk0SECRET0token"


@pytest.fixture
def corpus_behind_credentials():
    """A newline-free corpus on 127.0.0.1 that is served only with HTTP basic auth
    reader:SECRET_PASSWORD and ?token=SECRET_TOKEN. Yields (url, body, list of answered requests)."""
    body = CORPUS.read_text(encoding="utf-8")[:100_000].replace("\n", " ").encode()
    expected_auth = "Basic " + base64.b64encode(f"reader:{SECRET_PASSWORD}".encode()).decode()
    answered = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Authorization") == expected_auth and f"token={SECRET_TOKEN}" in self.path
            answered.append(200 if ok else 403)
            self.send_response(answered[-1])
            self.send_header("Content-Length", str(len(body) if ok else 0))
            self.end_headers()
            if ok:
                self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = (f"http://reader:{SECRET_PASSWORD}@127.0.0.1:{server.server_address[1]}/corpus.txt"
           f"?v=1&token={SECRET_TOKEN}")
    yield url, body, answered
    server.shutdown()
    server.server_close()


@pytest.mark.launch
def test_two_process_run_has_one_finished_wandb_run_and_no_secret(tmp_path, corpus_behind_credentials):
    """One launch (launches cost seconds of imports) for the 2-process checks: one wandb run, written
    by the tracker rank only; and two faults once seen: (1) the corpus has no "\n", which the
    end-of-run sample used to start from: the finished run exited 2, its wandb run stayed unfinished
    and rank 1 lost its peer; (2) data.path holds a password and a token, which were copied into
    config.yaml, meta.json, model.pt, wandb and stdout. The download must still use them."""
    url, body, answered = corpus_behind_credentials
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    r = torchrun(2, ["main.py", *TINY, f"data.path={url}", f"data.sha256={hashlib.sha256(body).hexdigest()}",
                     "data.offline_fallback=false", f"data.cache_dir={cache}", f"trainer.run_dir={run_dir}",
                     "parallel.strategy=ddp", "wandb.enabled=true", "trainer.max_steps=5"],
                 timeout=240, WANDB_CONFIG_DIR=tmp_path / "wandb-home")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]  # every rank exited 0
    (run,) = offline_runs(run_dir)
    assert list((run_dir / "wandb").glob("*run-*")) == [run]  # no online folder either
    w = read_wandb_run(run)
    assert w["run"].run_id == json.loads((run_dir / "tracker.json").read_text())["run_id"]
    assert w["run"].run_id == snapshot_meta(run_dir, 5)["tracker_run_id"]
    assert [h["_step"] for h in w["history"] if "loss" in h] == [5]
    assert w["config"]["parallel"]["strategy"] == "ddp"
    assert metric_steps(run_dir) == [5]  # written once, by the tracker rank only
    progress = [ln for ln in r.stderr.splitlines() if ln.startswith("step 5/5")]
    assert len(progress) == 1, r.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert METRIC_KEYS <= rows[-1].keys() and "peak_mem_mb" not in rows[-1], rows[-1]

    # (1) no "\n" in the vocabulary, and still a sample, a finished wandb run, exit 0 everywhere
    assert "\n" not in json.loads((run_dir / "tokenizer.json").read_text(encoding="utf-8"))["chars"]
    assert (run_dir / "sample.txt").is_file() and "done: step 5" in r.stdout
    assert w["summary"]["final_step"] == 5 and "sample_text" in w["summary"]
    assert any(rec.WhichOneof("record_type") == "exit" for rec in wandb_records(next(run.glob("*.wandb"))))
    # (2) downloaded once with the real credentials; then in no file of the run folder or the
    # cache (wandb's offline log included), no file name, no output line
    assert answered == [200], answered
    config_path = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["path"]
    assert config_path == url.replace(SECRET_PASSWORD, "***").replace(SECRET_TOKEN, "***")
    for secret in (SECRET_PASSWORD, SECRET_TOKEN):
        for path in [*run_dir.rglob("*"), *cache.rglob("*")]:
            assert secret not in str(path), path
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), f"{secret} written into {path}"
        assert secret not in r.stdout + r.stderr, "secret printed"


# ----------------------------------------------------------------------------- in process


def test_wandb_failure_mid_run_warns_once_and_metrics_go_on(tmp_path, monkeypatch):
    from checks import load_config
    from observe.tracker import RunTracker

    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    cfg = load_config(None, ["wandb.mode=disabled"])
    tracker = RunTracker(cfg, tmp_path, resume_step=None)

    class BrokenRun:
        def log(self, *a, **k):
            raise ConnectionError(f"service down (key {FAKE_KEY})")

    tracker._wandb = BrokenRun()  # as if wandb.init had worked and the service died later
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            tracker.log(step, {"loss": 1.0 / step})
        tracker.log_text("sample", "text")
        tracker.summary({"final_step": 3})
        tracker.finish()
    assert len(caught) == 1 and "wandb log failed" in str(caught[0].message)
    assert FAKE_KEY not in str(caught[0].message) and "***" in str(caught[0].message)
    assert metric_steps(tmp_path) == [1, 2, 3]
    # nothing reached wandb, so the run holds no step: a restart must not skip any
    assert json.loads((tmp_path / "tracker.json").read_text())["last_logged_step"] == -1


def test_tracker_state_fresh_start_resume_and_elastic_restart(tmp_path, monkeypatch):
    from checks import load_config
    from observe.tracker import RunTracker

    cfg = load_config(None, ["wandb.mode=disabled"])
    rows = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (5, 10, 15)) + "{broken\n"
    (tmp_path / "metrics.jsonl").write_text(rows)
    (tmp_path / "tracker.json").write_text(json.dumps({"run_id": "old00001", "last_logged_step": 15}))

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    resumed = RunTracker(cfg, tmp_path, resume_step=10, resume_run_id="old00001")
    assert (resumed.run_id, resumed.last_logged_step) == ("old00001", 15)
    assert metric_steps(tmp_path) == [5, 10]

    other = RunTracker(cfg, tmp_path, resume_step=10, resume_run_id="other001")
    assert (other.run_id, other.last_logged_step) == ("other001", -1)  # tracker.json was another run

    (tmp_path / "tracker.json").write_text(json.dumps({"run_id": "old00001", "last_logged_step": 15}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarted before the first snapshot
    restarted = RunTracker(cfg, tmp_path, resume_step=None)
    assert (restarted.run_id, restarted.last_logged_step) == ("old00001", 15)
    assert metric_steps(tmp_path) == []

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a manual launch without snapshot: new run
    (tmp_path / "metrics.jsonl").write_text(rows)
    fresh = RunTracker(cfg, tmp_path, resume_step=None)
    assert fresh.run_id != "old00001" and len(fresh.run_id) == 8 and fresh.last_logged_step == -1
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("override, words", [
    ("wandb.mode=dryrun", "wandb.mode"),
    ("wandb.mode=ofline", "did you mean 'offline'"),
    ("wandb.project=team/proj", "wandb.project"),
    ("wandb.project=" + "p" * 129, "wandb.project"),
    ("wandb.project=", "wandb.project is empty"),
    ("wandb.entity=a#b", "wandb.entity"),
    (r'wandb.name="two\nlines"', "wandb.name"),
    ("wandb.group=" + "g" * 129, "wandb.group"),
    ("wandb.tags=ok," + "t" * 65, "wandb.tags"),
    ("wandb.tags={a: 1}", "wandb.tags"),
    ("wandb.dir=config.py", "wandb.dir"),
    ("wandb.enabled=maybe", "wandb.enabled"),
    ("wandb.name=[1, 2]", "wandb.name"),
])
def test_bad_wandb_config_is_a_usage_error(override, words, monkeypatch):
    from checks import load_config
    from config import UsageError

    monkeypatch.chdir(REPO)
    with pytest.raises(UsageError, match=words.replace("(", r"\(")) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)


def test_good_wandb_config_and_mode_resolution(monkeypatch):
    from checks import load_config
    from observe.tracker import wandb_mode

    cfg = load_config(None, ["wandb.tags=a,b", "wandb.name=my run", "wandb.project=", "wandb.enabled=false"])
    assert cfg.wandb.tags == ["a", "b"] and wandb_mode(cfg) == "disabled"
    cfg = load_config(None, [])
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode(cfg) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert wandb_mode(cfg) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode(cfg) == "offline"
    assert wandb_mode(load_config(None, ["wandb.mode=disabled"])) == "disabled"


# ----------------------------------------------------------------------------- progress view


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal():
    from observe.tracker import Progress

    term = FakeTerminal()
    p = Progress(total=20, start=0, enabled=True, stream=term)
    assert p.bar is not None
    row = {"loss": 2.5, "lr": 1e-3, "tokens_per_sec": 12345.0, "mfu": 0.123}
    for step in (5, 10):
        p.update(step, row)
    p.message("step 10: val loss 2.4000")
    p.close()
    out = term.getvalue()
    assert "\r" in out and "10/20" in out and "val loss 2.4000" in out
    assert "loss 2.5000" in out and "12,345 tok/s" in out and "mfu 12.3%" in out
    assert "<" in out.split("10/20")[-1]  # tqdm's [elapsed<ETA]


def test_progress_plain_lines_and_silence():
    from observe.tracker import Progress

    pipe = io.StringIO()  # isatty() is False
    p = Progress(total=20, start=10, enabled=True, stream=pipe)
    p.update(15, {"loss": 2.5, "lr": 1e-3, "tokens_per_sec": 1000.0, "mfu": 0.5})
    p.close()
    line = pipe.getvalue()
    assert line.startswith("step 15/20 (75%) | loss 2.5000") and "eta 0:00" in line and "\r" not in line
    quiet = FakeTerminal()
    p = Progress(total=20, start=0, enabled=False, stream=quiet)
    p.update(5, {"loss": 1.0, "lr": 1e-3, "tokens_per_sec": 1.0, "mfu": 0.0})
    assert p.bar is None and quiet.getvalue() == ""
