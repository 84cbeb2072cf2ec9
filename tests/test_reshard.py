"""Resume on another world size and another strategy: one run folder is trained in
segments, each launch resuming the previous launch's snapshot with a different layout:

    ddp x2 -> ddp x1 -> fsdp x2 (strategy switch) -> hsdp 2x2 (x4) -> tp=2
    -> none x1 (tp=2 -> tp=1) -> zero-2 x2 -> pp=2 -> cp=2 (x2) -> fsdp dp2 x cp2 (x4) -> none x1

(cp splits each sequence and changes no model state: its segments resume another cp and another
world size in the same data order.)

(zero-3 is FSDP2 with fsdp's defaults: its segments would repeat the fsdp ones. A sharded snapshot
grows 2 -> 4 and shrinks 4 -> 2; each launch of four processes costs ~20 s on 2 cores.)

The global batch and data order do not depend on the layout, so the loss curve of the whole
chain must match one uninterrupted single-process run step by step, within reduction-order
tolerance (different layouts sum gradients in different orders; AdamW then amplifies ~1e-8
gradient differences into ~1e-6 relative loss differences over these few steps). The loss alone
would see a wrong optimizer state in one step per segment (a segment's first loss is computed
before its first update), so the chain is held to the parity bounds of testing/parity.py on every
figure it logs: the loss and the pre-clip gradient norm at every step, and the parameters at the
end (model.pt). `test_the_check_fails_a_resume_that_drops_the_optimizer_state` shows, in one
process, that a resume which drops the optimizer state fails it."""
from __future__ import annotations

import pytest

import main as app
import trainer as trainer_module
from harness import metric_rows, model_tensors
from testing.local import TINY, torchrun
from testing.parity import LOSS_RTOL, NORM_RTOL, PARAM_ATOL

STEPS = 2  # per segment
COMMON = TINY + ["trainer.log_every=1", "trainer.eval_every=1000", "trainer.sample_tokens=0",
                 "optimizer.lr_decay_steps=24", "trainer.keep_snapshots=1"]
CHAIN = [
    (2, ["parallel.strategy=ddp"]),
    (1, ["parallel.strategy=ddp"]),
    (2, ["parallel.strategy=fsdp"]),
    (4, ["parallel.strategy=fsdp", "parallel.dp_replicate=2"]),  # HSDP: 2 replicas x 2 shards
    (2, ["parallel.strategy=none", "parallel.tp=2"]),
    (1, ["parallel.strategy=none"]),
    (2, ["parallel.strategy=zero", "parallel.zero_stage=2"]),
    (2, ["parallel.strategy=none", "parallel.pp=2"]),
    (2, ["parallel.strategy=none", "parallel.cp=2"]),
    (4, ["parallel.strategy=fsdp", "parallel.cp=2"]),  # dp 2 x cp 2
    (1, ["parallel.strategy=none"]),
]


def logged(run_dir, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in metric_rows(run_dir) if key in r}


def segment(nproc: int, args: list[str], capsys) -> tuple[int, str, str]:
    """One launch of the chain: torchrun for several ranks; one process runs in this one (as the
    reference does: a subprocess would only add its imports)."""
    if nproc > 1:
        r = torchrun(nproc, ["main.py", *args])
        return r.returncode, r.stdout, r.stderr
    capsys.readouterr()
    code = app.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def curve_errors(ref_dir, run, total: int, chain: list) -> list[str]:
    """Where the run folder `run`, trained in segments of `chain`, leaves the uninterrupted run's
    curve: the loss and gradient norm of every step, the parameters at the end."""
    errors = []
    for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", NORM_RTOL)):
        ref, got = logged(ref_dir, key), logged(run, key)
        if not sorted(got) == sorted(ref) == list(range(1, total + 1)):
            errors.append(f"{key}: steps {sorted(got)} vs {sorted(ref)}")
            continue
        errors += [f"step {step} ({chain[(step - 1) // STEPS][1]}): {key} {got[step]} vs uninterrupted {want} "
                   f"(rel {abs(got[step] - want) / abs(want):.1e})"
                   for step, want in ref.items() if abs(got[step] - want) > rtol * abs(want)]
    ta, tb = model_tensors(ref_dir), model_tensors(run)
    assert ta.keys() == tb.keys()
    worst = max((ta[k] - tb[k]).abs().max().item() for k in ta)
    if worst > PARAM_ATOL:
        errors.append(f"parameters after step {total}: {worst:.2e} from the uninterrupted run's")
    return errors


def train_chain(chain: list, tmp_path, capsys) -> list[str]:
    total = STEPS * len(chain)
    ref_dir = tmp_path / "reference"
    assert app.main(COMMON + [f"trainer.run_dir={ref_dir}", "parallel.strategy=none",
                              f"trainer.max_steps={total}"]) == 0
    run = tmp_path / "chain"
    for i, (nproc, layout) in enumerate(chain):
        args = [*COMMON, *layout, f"trainer.run_dir={run}", f"trainer.max_steps={STEPS * (i + 1)}"]
        code, out, err = segment(nproc, args, capsys)
        assert code == 0, f"segment {i} ({nproc} x {layout}):\n{out[-2000:]}\n{err[-3000:]}"
        if i:
            assert f"at step {STEPS * i}" in out, f"segment {i} did not resume:\n{out[-2000:]}"
    return curve_errors(ref_dir, run, total, chain)


@pytest.mark.launch
def test_chain_of_layouts_continues_the_same_curve(tmp_path, capsys):
    errors = train_chain(CHAIN, tmp_path, capsys)
    assert not errors, "\n".join(errors)


def test_the_check_fails_a_resume_that_drops_the_optimizer_state(tmp_path, capsys, monkeypatch):
    """The chain's check, on three one-process segments: it passes as they are, and fails once
    each resume forgets AdamW's moments (measured: loss 2.6e-4 and norm 1.4e-2 apart at a
    segment's second step, the parameters 6e-3 apart at the end)."""
    one = [(1, ["parallel.strategy=none"])] * 3
    assert train_chain(one, tmp_path / "kept", capsys) == []
    resume = trainer_module.Trainer.resume

    def resume_and_forget(self):
        meta = resume(self)
        self.optimizer.state.clear()
        return meta
    monkeypatch.setattr(trainer_module.Trainer, "resume", resume_and_forget)
    errors = train_chain(one, tmp_path / "dropped", capsys)
    assert any("grad_norm" in e for e in errors) and any("parameters" in e for e in errors), errors
