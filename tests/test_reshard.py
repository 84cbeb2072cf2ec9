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
end (model.pt). A resume that drops the optimizer state fails the norm and parameter checks at
once (checked by hand: the optimizer state cleared after each resume's load)."""
from __future__ import annotations

import pytest

import main as app
from harness import metric_rows, model_tensors
from testing.local import TINY, torchrun
from testing.parity import LOSS_RTOL, NORM_RTOL, PARAM_ATOL

pytestmark = pytest.mark.launch

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


def test_chain_of_layouts_continues_the_same_curve(tmp_path, capsys):
    total = STEPS * len(CHAIN)
    ref_dir = tmp_path / "reference"
    assert app.main(COMMON + [f"trainer.run_dir={ref_dir}", "parallel.strategy=none",
                              f"trainer.max_steps={total}"]) == 0
    run = tmp_path / "chain"
    for i, (nproc, layout) in enumerate(CHAIN):
        args = [*COMMON, *layout, f"trainer.run_dir={run}", f"trainer.max_steps={STEPS * (i + 1)}"]
        code, out, err = segment(nproc, args, capsys)
        assert code == 0, f"segment {i} ({nproc} x {layout}):\n{out[-2000:]}\n{err[-3000:]}"
        if i:
            assert f"at step {STEPS * i}" in out, f"segment {i} did not resume:\n{out[-2000:]}"
    for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", NORM_RTOL)):
        ref, got = logged(ref_dir, key), logged(run, key)
        assert sorted(got) == sorted(ref) == list(range(1, total + 1)), key
        for step, want in ref.items():
            assert abs(got[step] - want) <= rtol * abs(want), (
                f"step {step} ({CHAIN[(step - 1) // STEPS][1]}): {key} {got[step]} vs uninterrupted {want} "
                f"(rel {abs(got[step] - want) / abs(want):.1e})")
    ta, tb = model_tensors(ref_dir), model_tensors(run)
    assert ta.keys() == tb.keys()
    worst = max((ta[k] - tb[k]).abs().max().item() for k in ta)
    assert worst <= PARAM_ATOL, f"parameters after step {total}: {worst:.2e} from the uninterrupted run's"
