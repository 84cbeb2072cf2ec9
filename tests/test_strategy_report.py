"""benchmarks/strategy_report.py and its counters measure what the planner predicts.

- measure.CollectiveCounter against collectives of known size, one 2-process launch
  (tests/count_worker.py): each kind counted once with its exact payload (the c10d ops, the
  project's gloo reduce-scatter as an all-to-all, a functional collective, a DTensor
  redistribution, a send, a sub-group's ranks), and the loopback bytes of an all-reduce and an all-gather of K bytes
  within 1% above a ring's volume, as the README says (TCP/IP headers: about 0.1% at loopback's 64 KiB packets; the
  barriers around them: a few hundred bytes);
- the report end to end at N=2 on the tiny model with eight layouts (ddp, fsdp, tp, tp + sp + vocab,
  pp 1f1b, ZB-V, cp ring and allgather): report.json
  says predicted and measured agree as the README says they do at N=4 (memory within 128 bytes per
  category, bytes moved exactly) in every category, the peak each rank really holds through a step
  (the allocator's count) is within -5% / +12% of the planned peak for ddp, each
  layout's step time is the median of its timed runs beside the predicted one, report.md and the
  three plots are written.
"""
from __future__ import annotations

import json
import statistics

import pytest

from testing.local import TINY, python, torchrun
from tools.measure import ring_moved

pytestmark = pytest.mark.launch

K = 4 * 2**18
PEAK_ABOVE, PEAK_BELOW = 0.12, 0.05  # the held peak against the planned (check_held_peaks)


def test_counter_against_collectives_of_known_size(tmp_path):
    r = torchrun(2, ["tests/count_worker.py", "--out", str(tmp_path)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "counted.json").read_text())
    calls = [(c["kind"], c["op"], c["group_size"], c["payload"]) for c in got["calls"]]
    assert calls == [
        ("all-reduce", "c10d.allreduce_", 2, K),
        ("all-to-all", "c10d.alltoall_base_", 2, K),  # parallel.collectives.reduce_scatter on gloo
        ("reduce-scatter", "c10d._reduce_scatter_base_", 2, K),
        ("all-gather", "c10d._allgather_base_", 2, K),
        ("all-reduce", "_c10d_functional.all_reduce", 2, K),
        ("send", "c10d.send", 2, 4000),
        ("all-reduce", "c10d.allreduce_", 1, 40),  # on a sub-group of rank 0 alone
        ("all-gather", "_c10d_functional.all_gather_into_tensor", 2, K),  # DTensor Shard(0) -> Replicate
    ]
    # all ranks together: n x the ring volume per rank
    for kind, lo in got["lo"].items():
        ring = 2 * ring_moved(kind, K, 2)
        assert ring <= lo <= 1.01 * ring, (kind, lo, ring)


def test_report_end_to_end_two_processes(tmp_path):
    out = tmp_path / "report"
    model = [a for a in TINY if not a.startswith(("data.path", "trainer.eval", "trainer.log", "trainer.save",
                                                  "trainer.sample", "wandb", "optimizer"))]
    r = python(["benchmarks/strategy_report.py", "--nproc", "2", "--out", str(out), "--steps", "1", "--repeats", "2",
                "--min-run-ms", "0", "--layouts", "ddp dp2,fsdp dp2,tp2,tp2 +sp +vocab,pp2 1f1b,pp2 zero-bubble V,cp2 ring,cp2 allgather", *model,
                "trainer.micro_batch_size=0"], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [lay["name"] for lay in report["layouts"]] == ["ddp dp2", "fsdp dp2", "tp2", "tp2 +sp +vocab", "pp2 1f1b",
                                                          "pp2 zero-bubble V", "cp2 ring", "cp2 allgather"]
    for lay in report["layouts"]:
        for c in lay["memory"]:
            assert abs(c["measured"] - c["predicted"]) <= 128, (lay["name"], c)
        kinds = {c["what"] for c in lay["moved"]}
        assert kinds, lay["name"]
        for c in lay["moved"]:
            assert c["measured"] == c["predicted"], (lay["name"], c)
        assert lay["ok"] and lay["wire_bytes_per_step"] > 0 and lay["tokens_per_s"] > 0
        # the step time --plan predicts on `--hardware local` beside the median of the measured runs
        assert len(lay["step_runs_s"]) == 2 and lay["steps_per_run"] == 1 and lay["step_s"] == pytest.approx(statistics.median(lay["step_runs_s"]))
        assert lay["step_predicted_s"] > 0 and lay["time_ratio"] == pytest.approx(lay["step_s"] / lay["step_predicted_s"])
        assert {name for name, _ in lay["time_terms"]} >= {"compute", "optimizer"}
    assert {"tp"} <= {c["what"] for c in report["layouts"][2]["moved"]}
    assert {"send-recv", "all-reduce"} <= {c["what"] for c in report["layouts"][4]["moved"]}
    assert report["layouts"][4]["bubble_measured"] is not None
    # context parallelism: attention's sends (ring) or all-gather + reduce-scatter (allgather), and the
    # gradient all-reduce over cp, each exactly as planned (above)
    assert all({"cp", "all-reduce"} <= {c["what"] for c in lay["moved"]} for lay in report["layouts"][6:])
    check_held_peaks(report)
    text = (out / "report.md").read_text()
    assert "| fsdp dp2 |" in text and "![memory](memory.png)" in text and "pairs ordered alike" in text
    assert "## Peak memory per rank (MB): planned vs really held" in text
    for png in ("memory.png", "bytes.png", "time.png"):
        assert (out / png).stat().st_size > 10_000


def check_held_peaks(report: dict) -> None:
    """The peak each rank really holds through a step (tools/held_memory.py HeldPeak: the allocator's
    count, from before the model is built) against the planned peak, for ddp, where the plan's sum
    is what is live at once (16a from the first step on: its buckets are the gradients, + the
    activations). Above the plan: what it leaves out (autograd's temporaries in backward, the data
    order's permutation), 3% here; against a plan that leaves out ddp's 4a of buckets, 21%. Not held
    to a bar (docs/planner.md, the peak really held): the pipeline schedules, 10-45% above their
    plan (pp 1f1b +15% on this model), and fsdp, whose figure moved by 10% between runs (frees on
    gloo's threads that the profiler misses)."""
    peaks = {lay["name"]: lay["peak"] for lay in report["layouts"]}
    assert all(c["measured"] > 0 for lay in report["layouts"] for c in lay["peak"])
    assert peaks["ddp dp2"]
    for c in peaks["ddp dp2"]:
        assert -PEAK_BELOW <= c["measured"] / c["predicted"] - 1 <= PEAK_ABOVE, c


@pytest.mark.parametrize("flags, says", [(["--layouts", "ddp dp3"], "error: unknown layout"),
                                         (["--min-run-ms", "-1"], "error: --steps and --repeats must be")])
def test_report_refuses_bad_flags_with_one_line(tmp_path, flags, says):
    r = python(["benchmarks/strategy_report.py", "--nproc", "2", "--out", str(tmp_path / "x"), *flags], timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(says) and r.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("override, says", [("trainer.attention=matmul", "trainer.attention=matmul holds"),
                                            ("trainer.precision=auto", "trainer.precision=auto is chosen at launch")])
def test_report_refuses_what_the_planner_cannot_price(tmp_path, override, says):
    """The report compares runs with the plan: a setting the plan does not model (matmul attention's
    T x T probabilities, a precision chosen at launch) is refused in one line before any process
    starts, as --plan refuses it, instead of a table of wrong predictions."""
    r = python(["benchmarks/strategy_report.py", "--nproc", "2", "--out", str(tmp_path / "x"), override], timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: strategy_report.py prices") and says in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "x").exists()
