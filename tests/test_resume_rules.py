"""A resume must not silently change the run.

- A resume whose data stream differs from the snapshot's (corpus content, data.truncate,
  data.val_fraction, trainer.seed, trainer.batch_size, model.block_size) is refused with one line
  naming each changed key, its snapshot value and the fix; nothing in the run folder changes.
  So is another optimizer.name (AdamW's state does not load into Muon's).
- A resume with another optimizer.lr / betas / weight_decay runs the configured values from the
  resume step (param groups and the logged lr follow lr_at with the new config).
- CUDA RNG states are recorded and restored with the CPU one (CPU-only here: torch.cuda's RNG
  functions are replaced by a stand-in that holds a byte state, to check the record and restore).
- Dropout under tensor parallelism: after a dp=2 -> tp=2 resume, and a tp=2 -> tp=2 one, every
  replicated parameter stays bit-identical across the tp peers (one torchrun launch).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checks import load_config
from harness import app_in_process
from launch.build import build_trainer
from launch.schedule import lr_at
from parallel.env import init_distributed
from parallel.strategy import Strategy
from snapshots.store import SnapshotManager
from testing.local import CORPUS, TINY, torchrun

BASE = TINY + ["parallel.strategy=none", "trainer.sample_tokens=0", "optimizer.lr_decay_steps=20"]


train = app_in_process(BASE)


def folder_bytes(run_dir: Path) -> dict:
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_a_changed_data_stream_is_refused_with_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "trainer.max_steps=5") == 0
    before = folder_bytes(run)
    # the same characters, other text: a changed corpus the stored tokenizer still encodes
    text = CORPUS.read_text(encoding="utf-8")[:200000]
    edited = tmp_path / "edited.txt"
    edited.write_text(text.replace("the", "eht"), encoding="utf-8")
    same = tmp_path / "copy.txt"  # same content at another path: not a change
    same.write_text(text, encoding="utf-8")
    cases = [
        (["data.val_fraction=0.2", "trainer.seed=7"],
         ["data.val_fraction=0.1 (now 0.2)", "trainer.seed=1337 (now 7)"]),
        (["trainer.batch_size=4", "trainer.micro_batch_size=0"], ["trainer.batch_size=8 (now 4)"]),
        (["data.truncate=150000"], ["data.truncate=200000 (now 150000)"]),
        ([f"data.path={edited}"], ["corpus sha256="]),
        (["model.block_size=32"], ["model.block_size=16 (now 32)", "different model shape"]),
        (["optimizer.name=muon"], ["optimizer.name=adamw (now muon)", "different optimizer"]),  # AdamW's state
    ]
    capsys.readouterr()
    for overrides, expected in cases:
        assert train(run, "trainer.max_steps=8", *overrides) == 2, overrides
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: snapshot "), err
        for text in expected:
            assert text in lines[0], (overrides, lines[0])
        assert "use the snapshot's values or another trainer.run_dir" in lines[0]
        assert folder_bytes(run) == before, overrides
    # the corpus is identified by its content: a copy elsewhere resumes
    assert train(run, "trainer.max_steps=8", f"data.path={same}") == 0
    assert "resumed from" in capsys.readouterr().out


def test_resume_runs_the_configured_optimizer_and_logs_it(tmp_path):
    run = tmp_path / "run"
    assert train(run, "trainer.max_steps=5", "trainer.log_every=1") == 0
    new = ["optimizer.lr=3e-3", "optimizer.min_lr=2e-4", "optimizer.beta1=0.8", "optimizer.beta2=0.95",
           "optimizer.weight_decay=0.05", "optimizer.warmup_steps=3", "trainer.log_every=1",
           "trainer.max_steps=8"]
    cfg = load_config(None, BASE + [f"trainer.run_dir={run}", *new])
    trainer = build_trainer(cfg, init_distributed(cfg), run)
    assert trainer.resume() is not None and trainer.step == 5
    groups = trainer.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    for g in groups:
        assert g["betas"] == (0.8, 0.95)
        assert g["lr"] == pytest.approx(lr_at(5, cfg, 8), rel=1e-12)
        assert g["initial_lr"] == 3e-3
    # the whole app: every logged lr after the resume is what lr_at gives with the new config
    assert train(run, *new) == 0
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6, 7, 8]
    old = load_config(None, BASE + ["trainer.max_steps=5"])
    for step, lr in lrs.items():
        want = lr_at(step - 1, cfg if step > 5 else old, 8 if step > 5 else 5)
        assert lr == pytest.approx(want, rel=1e-12), (step, lr, want)


class FakeCudaRng:
    """torch.cuda's RNG functions on a machine without CUDA: a 16-byte state per GPU (GPU i's filled
    with fill + i) that set/get move; `restored` records (GPU, state) of every set."""

    def __init__(self, fill: int):
        self.fill = fill
        self.restored: list[tuple[int, torch.Tensor]] = []

    def install(self, monkeypatch, gpus: list[int]):
        def index(device) -> int:
            return device if isinstance(device, int) else torch.device(device).index or 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_rng_state",
                            lambda device="cuda": torch.full((16,), self.fill + index(device), dtype=torch.uint8))
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda s, device="cuda": self.restored.append((index(device), s.clone())))
        # the strategy's GPUs, as on a GPU node: one of its own, or nn.DataParallel's replicas' GPUs
        monkeypatch.setattr(Strategy, "rng_gpus", property(lambda strategy: gpus))


@pytest.mark.parametrize("gpus, keys", [
    ([0], {"rank0", "rank0_cuda"}),  # a rank's own GPU
    ([0, 1, 2], {"rank0", "rank0_cuda0", "rank0_cuda1", "rank0_cuda2"}),  # nn.DataParallel's replicas: every GPU's
])
def test_cuda_rng_state_of_every_gpu_the_rank_draws_on_is_saved_and_restored(tmp_path, monkeypatch, gpus, keys):
    """Dropout on GPU draws from each GPU's own generator: nn.DataParallel's replicas on GPUs 1..N
    too. A resume restores each GPU's state (before, only the current GPU's was kept, and the
    replicas on the others replayed their first masks)."""
    run = tmp_path / "run"
    cfg = load_config(None, BASE + [f"trainer.run_dir={run}", "trainer.max_steps=2", "trainer.device=cpu"])
    trainer = build_trainer(cfg, init_distributed(cfg), run)
    trainer.train_step()
    with monkeypatch.context() as m:
        FakeCudaRng(fill=7).install(m, gpus)
        tensors = trainer.state_tensors()
    assert set(tensors["rng"]) == keys
    # written outside the stand-in: DCP's writer would use CUDA streams
    path = trainer.snapshots.save(trainer.step, tensors, trainer.state_meta())
    assert {f"rng.{k}" for k in keys} <= SnapshotManager.stored_keys(path)

    later = FakeCudaRng(fill=0)  # a fresh process: its CUDA generators are elsewhere
    later.install(monkeypatch, gpus)
    resumed = build_trainer(cfg, init_distributed(cfg), run)
    assert resumed.resume() is not None and resumed.rng_note is None
    assert sorted((gpu, int(state[0])) for gpu, state in later.restored) == [(g, 7 + g) for g in gpus]


def test_a_snapshot_without_every_gpus_rng_state_restarts_the_streams_with_a_note(tmp_path, monkeypatch):
    """Written on one GPU, resumed by nn.DataParallel on two: the snapshot lacks GPU 1's generator,
    so every stream is derived from (seed, step) and the start-up says so."""
    run = tmp_path / "run"
    cfg = load_config(None, BASE + [f"trainer.run_dir={run}", "trainer.max_steps=2", "trainer.device=cpu"])
    trainer = build_trainer(cfg, init_distributed(cfg), run)
    trainer.train_step()
    with monkeypatch.context() as m:
        FakeCudaRng(fill=7).install(m, [0])
        tensors = trainer.state_tensors()
    trainer.snapshots.save(trainer.step, tensors, trainer.state_meta())
    later = FakeCudaRng(fill=0)
    later.install(monkeypatch, [0, 1])
    resumed = build_trainer(cfg, init_distributed(cfg), run)
    assert resumed.resume() is not None and later.restored == []
    assert resumed.rng_note.startswith(f"note: {run / 'snapshots'}") and "rank0_cuda0, rank0_cuda1" in resumed.rng_note


@pytest.mark.launch
def test_tp_peers_keep_identical_replicated_parameters_with_dropout_after_a_resume(tmp_path):
    r = torchrun(2, ["tests/resume_worker.py", "--out", str(tmp_path)], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "tp_replicas.json").read_text())
    for phase in ("dp2_to_tp2", "tp2_to_tp2"):
        diffs = report[phase]
        assert len(diffs) >= 10, diffs  # LayerNorms, row-parallel biases, embeddings...
        drifted = {k: v for k, v in diffs.items() if v != 0.0}
        assert not drifted, f"{phase}: replicated parameters differ across tp peers: {drifted}"
