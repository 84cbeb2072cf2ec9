"""The time model's terms that depend on where a rank's work falls: a collective's latency by the
compute since the rank's previous call (planner/timing.py step_latency), and context
parallelism's attention beyond one fused attention (planner/compute.py context_parallel_extra); both figures read
from a hardware file, and a bad one refused in one line."""
from __future__ import annotations

import dataclasses

import pytest

import main as app
import planner
from checks import load_config
from model import GPT
from planner.hardware import Link, load_hardware
from planner.timing import group_link, norm_all_reduces, step_latency
from testing.local import TINY

FAR, NEAR, GAP = 1e-3, 2e-4, 5e-3  # seconds per ring step after GAP of compute, and right after a call


def _base():
    """An h100 node cut to 2 devices with nothing overlapped: every term is exposed."""
    return dataclasses.replace(load_hardware("h100-sxm"), devices_per_node=2, overlap=False,
                               intra_node=Link(1e9, FAR), inter_node=Link(1e9, FAR))


def _plan(tmp_path, hw, *overrides):
    cfg = load_config(None, TINY + [f"trainer.run_dir={tmp_path}", "trainer.micro_batch_size=0", *overrides])
    return planner.plan_layout(cfg, planner.gpt_config(cfg, 65), planner.check_layout(cfg, 2), True, None, hw)


def test_a_call_pays_between_its_near_latency_and_its_latency_by_the_compute_before_it():
    """Right after another call: near_latency; after latency_gap of compute or more: latency; in
    proportion between. A link without near_latency, or hardware without latency_gap (every GPU
    file), pays latency whatever the gap."""
    gapped = dataclasses.replace(_base(), latency_gap=GAP)
    link = Link(1e9, FAR, NEAR)
    assert step_latency(link, 0.0, gapped) == pytest.approx(NEAR)
    assert step_latency(link, GAP / 4, gapped) == pytest.approx(NEAR + (FAR - NEAR) / 4)
    assert step_latency(link, GAP, gapped) == pytest.approx(FAR)
    assert step_latency(link, 10 * GAP, gapped) == pytest.approx(FAR)  # not beyond what was measured
    assert step_latency(Link(1e9, FAR), 0.0, gapped) == FAR
    assert step_latency(link, 0.0, _base()) == FAR


def _latency_s(tmp_path, overrides) -> float:
    """The seconds of a step's latency at FAR a ring step: the step less the same step on links of none."""
    none = dataclasses.replace(_base(), intra_node=Link(1e9, 1e-12), inter_node=Link(1e9, 1e-12))
    return _plan(tmp_path, _base(), *overrides).time.step_s - _plan(tmp_path, none, *overrides).time.step_s


def _near(latency_gap: float):
    return dataclasses.replace(_base(), intra_node=Link(1e9, FAR, NEAR), inter_node=Link(1e9, FAR, NEAR),
                               latency_gap=latency_gap)


@pytest.mark.parametrize("overrides", [
    ("parallel.strategy=none", "parallel.tp=2"), ("parallel.strategy=zero", "parallel.zero_stage=2"),
    ("parallel.strategy=none", "parallel.pp=2", "parallel.microbatches=4")])
def test_calls_that_follow_little_compute_pay_the_near_latency(tmp_path, overrides):
    """Measured after a gap far longer than any rank's compute per call, every ring step of the
    step (the collectives' and the gradient norm's) costs near_latency instead of latency."""
    far, latency_s = _plan(tmp_path, _base(), *overrides).time.step_s, _latency_s(tmp_path, overrides)
    near = _plan(tmp_path, _near(1e9), *overrides).time.step_s
    assert latency_s > 0 and far - near == pytest.approx(latency_s * (1 - NEAR / FAR), rel=1e-6)


@pytest.mark.parametrize("overrides", [
    ("parallel.strategy=none", "parallel.tp=2"), ("parallel.strategy=zero", "parallel.zero_stage=2")])
def test_each_rank_spreads_its_calls_over_its_compute(tmp_path, overrides):
    """A rank's gap is its compute over its calls in a step (the collectives' and the gradient
    norm's): with latency_gap 4 x that gap, each ring step costs a quarter of the way from
    near_latency to latency."""
    far = _plan(tmp_path, _base(), *overrides)
    compute = {t.name: t.seconds for t in far.time.terms}["compute"]
    calls = sum(c.calls for c in far.collectives) + sum(n for _, _, n in norm_all_reduces(far.layout))
    quarter = _plan(tmp_path, _near(4 * compute / calls), *overrides).time.step_s
    saved = _latency_s(tmp_path, overrides) * (1 - (NEAR + (FAR - NEAR) / 4) / FAR)
    assert far.time.step_s - quarter == pytest.approx(saved, rel=1e-6)


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_context_parallel_pays_its_attention_per_block_and_per_element(tmp_path, mode):
    """cp_<mode>_overhead per block per micro-batch, cp_<mode>_elementwise per activation element
    (this rank's tokens x width per block), in the compute; the other mode's figures and every
    other layout are untouched. TINY: 4 blocks of 32 wide, batch 8 x block 16, cp 2: 64 tokens a rank."""
    cp = ("parallel.strategy=none", "parallel.cp=2", f"parallel.cp_mode={mode}")
    other = "allgather" if mode == "ring" else "ring"
    base = _base()
    priced = dataclasses.replace(base, **{f"cp_{mode}_overhead": 1e-3, f"cp_{mode}_elementwise": 1e-9})
    elsewhere = dataclasses.replace(base, **{f"cp_{other}_overhead": 1e-3, f"cp_{other}_elementwise": 1e-9})
    plans = [_plan(tmp_path, hw, *cp) for hw in (base, priced, elsewhere)]
    compute = [{t.name: t.seconds for t in p.time.terms}["compute"] for p in plans]
    micro = plans[0].layout.microbatches
    assert compute[1] - compute[0] == pytest.approx(4 * (micro * 1e-3 + 64 * 32 * 1e-9))
    assert compute[2] == compute[0]
    ddp = [_plan(tmp_path, hw, "parallel.strategy=ddp").time.step_s for hw in (base, priced)]
    assert ddp[0] == ddp[1]


@pytest.mark.parametrize("spec, message", [
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5, near_latency: -1.0e-6}\n", "needs near_latency: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5, near_latency: soon}\n", "needs near_latency: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\nlatency_gap: -0.007\n", "needs latency_gap: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\ninter", "needs near_latency: a positive number"),  # inter_node's
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\ncp_ring_overhead: -1\n", "needs cp_ring_overhead: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\ncp_allgather_elementwise: slow\n",
     "needs cp_allgather_elementwise: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\ncp_ring_elementwise: -1.0e-9\n",
     "needs cp_ring_elementwise: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\ncp_allgather_overhead: -1\n",
     "needs cp_allgather_overhead: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\nfsdp_call_latency: -1.0e-3\n",
     "needs fsdp_call_latency: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\nfsdp_byte_time: fast\n",
     "needs fsdp_byte_time: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\n"
     "all_gather_link: {bandwidth: 1.0e+9, latency: 1.0e-5, near_latency: 0}\n", "needs near_latency: a positive number"),
    ("intra_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\n"
     "reduce_scatter_link: {bandwidth: 1.0e+9, latency: 1.0e-5, near_latency: [1]}\n",
     "needs near_latency: a positive number"),
])
def test_bad_gap_and_cp_figures_are_one_line_exit_2(tmp_path, capsys, spec, message):
    bad = tmp_path / "bad.yaml"
    inter = ("inter_node: {bandwidth: 1.0e+9, latency: 1.0e-5, near_latency: -1}\n" if "intra_node: {bandwidth: 1.0e+9, "
             "latency: 1.0e-5}\ninter" in spec else "inter_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\n")
    bad.write_text("name: x\ndevices_per_node: 8\nmemory: 80GB\npeak_flops: {fp32: 1.0e+12}\n"
                   + inter + "memory_bandwidth: 1.0e+9\ncompute_efficiency: 0.5\n" + spec.replace("\ninter", "\n"))
    assert app.main(["--plan", "--hardware", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_hardware_file_reads_near_latency_and_the_gap(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("name: x\ndevices_per_node: 8\nmemory: 80GB\npeak_flops: {fp32: 1.0e+12}\n"
                    "intra_node: {bandwidth: 1.0e+9, latency: 1.0e-3, near_latency: 2.0e-4}\n"
                    "inter_node: {bandwidth: 1.0e+9, latency: 1.0e-5}\nmemory_bandwidth: 1.0e+9\n"
                    "compute_efficiency: 0.5\nlatency_gap: 0.005\ncp_ring_overhead: 3.0e-4\nfsdp_call_latency: 1.0e-3\n")
    hw = load_hardware(str(good))
    assert hw.intra_node == Link(1e9, 1e-3, 2e-4) and hw.inter_node.near_latency is None
    assert hw.latency_gap == 0.005 and hw.cp_ring_overhead == 3e-4 and hw.cp_allgather_overhead == 0.0
    assert hw.fsdp_call_latency == 1e-3 and load_hardware("h100-sxm").fsdp_call_latency == 0.0


@pytest.mark.parametrize("overrides, fsdp", [
    (("parallel.strategy=fsdp",), True), (("parallel.strategy=zero", "parallel.zero_stage=3"), True),
    (("parallel.strategy=fsdp", "parallel.reshard_after_forward=false"), True),
    (("parallel.strategy=ddp",), False), (("parallel.strategy=zero", "parallel.zero_stage=2"), False),
    (("parallel.strategy=none", "parallel.tp=2", "parallel.sequence_parallel=true"), False)])
def test_fsdp2s_own_calls_cost_at_least_the_measured_fsdp_call_latency(tmp_path, overrides, fsdp):
    """FSDP2's all-gathers and reduce-scatters pay max(fsdp_call_latency, the link's latency x
    ring steps) per call (2 ranks: one step a call): a floor, not an addition, so a link slower
    than it changes nothing. ZeRO-2's gathers and scatters, DDP's all-reduce and, without FSDP2,
    sequence parallelism's gathers keep the link's latency."""
    base = dataclasses.replace(_base(), gather_link=Link(1e9, 2e-4), scatter_link=Link(1e9, 3e-4))
    floor = dataclasses.replace(base, fsdp_call_latency=1e-3)
    plans = [_plan(tmp_path, hw, *overrides) for hw in (base, floor)]
    terms = [{t.name: t.seconds for t in p.time.terms} for p in plans]
    calls = {c.kind: c.calls for c in plans[0].collectives}
    for kind, latency in (("all-gather", 2e-4), ("reduce-scatter", 3e-4)):
        name = next((n for n in terms[0] if n.startswith(kind)), None)
        if fsdp:
            assert terms[1][name] - terms[0][name] == pytest.approx(calls[kind] * (1e-3 - latency))
        elif name:
            assert terms[1][name] == terms[0][name]
    assert {k: v for k, v in terms[1].items() if not k.startswith(("all-gather", "reduce-scatter"))} == \
        {k: v for k, v in terms[0].items() if not k.startswith(("all-gather", "reduce-scatter"))}
    slower = dataclasses.replace(base, gather_link=Link(1e9, 2e-3), scatter_link=Link(1e9, 2e-3))
    assert _plan(tmp_path, slower, *overrides).time.step_s == \
        _plan(tmp_path, dataclasses.replace(slower, fsdp_call_latency=1e-3), *overrides).time.step_s


def test_the_fsdp_call_floor_is_per_call_whatever_its_ring_steps(tmp_path):
    """fsdp over 4 ranks of one node: a gather is 3 ring steps. fsdp_call_latency (measured at 2
    ranks, one step a call) floors the call's latency, calls x max(floor, 3 x latency): a floor
    above 3 steps of the link's adds the difference per call, one below them nothing."""
    cfg = load_config(None, TINY + [f"trainer.run_dir={tmp_path}", "trainer.micro_batch_size=0", "parallel.strategy=fsdp"])
    base = dataclasses.replace(_base(), devices_per_node=4, gather_link=Link(1e9, 2e-4), scatter_link=Link(1e9, 2e-4))

    def gathers(hw):
        lp = planner.plan_layout(cfg, planner.gpt_config(cfg, 65), planner.check_layout(cfg, 4), True, None, hw)
        calls = next(c.calls for c in lp.collectives if c.kind == "all-gather")
        return next(t.seconds for t in lp.time.terms if t.name.startswith("all-gather")), calls
    (plain, calls), (floored, _) = gathers(base), gathers(dataclasses.replace(base, fsdp_call_latency=1e-3))
    assert floored - plain == pytest.approx(calls * (1e-3 - 3 * 2e-4))
    assert gathers(dataclasses.replace(base, fsdp_call_latency=5e-4))[0] == plain


@pytest.mark.parametrize("overrides, fsdp", [
    (("parallel.strategy=fsdp",), True), (("parallel.strategy=zero", "parallel.zero_stage=3"), True),
    (("parallel.strategy=fsdp", "parallel.reshard_after_forward=false"), True),
    (("parallel.strategy=zero", "parallel.zero_stage=2"), False)])
def test_fsdp2s_bytes_inside_a_node_cost_the_measured_fsdp_byte_time(tmp_path, overrides, fsdp):
    """FSDP2's all-gathers and reduce-scatters inside a node: their bytes sent x fsdp_byte_time
    instead of bytes / the link's bandwidth, their latency as before. ZeRO-2's gathers and
    scatters (the same kinds of call, another engine) keep the links' rates, and so does every call
    where the hardware gives no byte time."""
    base = dataclasses.replace(_base(), gather_link=Link(1e9, 2e-4), scatter_link=Link(2e9, 3e-4))
    priced = dataclasses.replace(base, fsdp_byte_time=5e-9)
    plans = [_plan(tmp_path, hw, *overrides) for hw in (base, priced)]
    terms = [{t.name: t.seconds for t in p.time.terms} for p in plans]
    sent = {c.kind: c.moved_bytes for c in plans[0].collectives}
    for kind, bandwidth in (("all-gather", 1e9), ("reduce-scatter", 2e9)):
        name = next((n for n in terms[0] if n.startswith(kind)), None)
        if fsdp:
            assert sent[kind] > 0 and terms[1][name] - terms[0][name] == pytest.approx(sent[kind] * (5e-9 - 1 / bandwidth))
        elif name:
            assert terms[1][name] == terms[0][name]
    assert {k: v for k, v in terms[1].items() if not k.startswith(("all-gather", "reduce-scatter"))} == \
        {k: v for k, v in terms[0].items() if not k.startswith(("all-gather", "reduce-scatter"))}
    assert plans[1].time.step_s > plans[0].time.step_s if fsdp else plans[1].time.step_s == plans[0].time.step_s


def test_hsdps_shard_gathers_pay_the_byte_time_and_its_replica_all_reduce_does_not(tmp_path):
    """HSDP on 4 ranks of one node: FSDP2's gathers and reduce-scatters within a shard group pay
    fsdp_byte_time for their bytes; the all-reduce of the shards across replica groups keeps the
    link's bandwidth."""
    cfg = load_config(None, TINY + [f"trainer.run_dir={tmp_path}", "trainer.micro_batch_size=0",
                                    "parallel.strategy=fsdp", "parallel.dp_replicate=2"])
    base = dataclasses.replace(_base(), devices_per_node=4, gather_link=Link(1e9, 2e-4), scatter_link=Link(1e9, 2e-4))

    def plan(hw):
        return planner.plan_layout(cfg, planner.gpt_config(cfg, 65), planner.check_layout(cfg, 4), True, None, hw)
    plain, priced = plan(base), plan(dataclasses.replace(base, fsdp_byte_time=5e-9))
    terms = [{t.name.split(" (")[0]: t.seconds for t in p.time.terms} for p in (plain, priced)]
    gathered = next(c.moved_bytes for c in plain.collectives if c.kind == "all-gather")
    assert terms[1]["all-gather dp_shard"] - terms[0]["all-gather dp_shard"] == pytest.approx(gathered * (5e-9 - 1e-9))
    assert terms[1]["all-reduce dp_replicate"] == terms[0]["all-reduce dp_replicate"]


def test_fsdp2s_bytes_across_nodes_keep_the_networks_bandwidth(tmp_path):
    """fsdp over 4 ranks, 2 per node: its gathers cross the network, which the byte time measured
    inside a node (2 local ranks) does not describe: nothing changes."""
    cfg = load_config(None, TINY + [f"trainer.run_dir={tmp_path}", "trainer.micro_batch_size=0", "parallel.strategy=fsdp"])
    base = _base()

    def step(hw):
        return planner.plan_layout(cfg, planner.gpt_config(cfg, 65), planner.check_layout(cfg, 4), True, None, hw).time.step_s
    assert step(base) == step(dataclasses.replace(base, fsdp_byte_time=5e-9))
    assert step(dataclasses.replace(base, devices_per_node=4)) < step(dataclasses.replace(base, devices_per_node=4,
                                                                                          fsdp_byte_time=5e-9))


def test_a_group_across_nodes_keeps_its_cards_near_latency(tmp_path):
    """fsdp over 4 ranks, 2 per node: the dp group runs 2 rings across nodes at the network's
    latencies, near_latency included."""
    hw = dataclasses.replace(_base(), intra_node=Link(100e9, 1e-5, 1e-6), inter_node=Link(1e9, FAR, NEAR))
    cfg = load_config(None, TINY + [f"trainer.run_dir={tmp_path}", "parallel.strategy=fsdp"])
    lay = planner.check_layout(cfg, 4)
    size, link, where = group_link(planner.plan_layout(cfg, planner.gpt_config(cfg, 65), lay, True, None, hw).layout,
                                   "dp", hw)
    assert (size, where) == (4, "inter-node, 2 cards") and (link.latency, link.near_latency) == (FAR, NEAR)


def test_ranks_sharing_a_core_compute_longer_between_calls(tmp_path):
    """4 ranks on a 2-core shared node: each rank's compute between two calls takes twice as long
    (every term is stretched by ranks / cores), so its gap is twice its unstretched compute over
    its calls: with latency_gap 4 x the unstretched gap, each ring step costs half the way from
    near_latency to latency, not a quarter."""
    def plan(latency_gap: float):
        hw = dataclasses.replace(_near(latency_gap), shared_node=True, block_overhead=1e-3)
        cfg = load_config(None, TINY + [f"trainer.run_dir={tmp_path}", "parallel.strategy=none", "parallel.tp=4",
                                        "trainer.micro_batch_size=0"])
        return planner.plan_layout(cfg, planner.gpt_config(cfg, 65), planner.check_layout(cfg, 4), True, None, hw)
    first = plan(1.0)
    compute = {t.name: t.seconds for t in first.time.terms}["compute"] / 2  # the stretch undone
    calls = sum(c.calls for c in first.collectives) + sum(n for _, _, n in norm_all_reduces(first.layout))
    lp = plan(4 * compute / calls)
    tp = {t.name: t.seconds for t in lp.time.terms}["tp tp (intra-node)"] / 2
    c = next(c for c in lp.collectives if c.kind == "tp")
    assert compute > 1e-3 and tp == pytest.approx(c.calls * 2 * (4 - 1) * (NEAR + (FAR - NEAR) / 2) + c.moved_bytes / 1e9,
                                                  rel=1e-6)


@pytest.mark.parametrize("overrides, width, grows", [
    (("parallel.cp=4",), 32, 3), (("parallel.cp=4", "parallel.cp_mode=allgather"), 32, 1),
    (("parallel.cp=2", "parallel.tp=2", "model.n_head=4"), 16, 1)])
def test_context_parallel_extra_at_other_degrees(tmp_path, overrides, width, grows):
    """At 4 ranks: the ring's figure x (cp - 1) (its blocks, merges and shifts per rank grow with
    cp), allgather's as measured; under cp x tp each rank's heads are width / tp wide."""
    base = dataclasses.replace(_base(), devices_per_node=4)
    priced = dataclasses.replace(base, cp_ring_overhead=1e-3, cp_ring_elementwise=1e-9, cp_allgather_overhead=1e-3,
                                 cp_allgather_elementwise=1e-9)
    cfg = load_config(None, TINY + [f"trainer.run_dir={tmp_path}", "parallel.strategy=none", "trainer.micro_batch_size=0",
                                    *overrides])
    g, lay = planner.gpt_config(cfg, 65), planner.check_layout(cfg, 4)
    plans = [planner.plan_layout(cfg, g, lay, True, None, hw) for hw in (base, priced)]
    compute = [{t.name: t.seconds for t in p.time.terms}["compute"] for p in plans]
    cp = plans[0].layout.cp
    tokens = 8 * 16 // cp  # batch 8 x block 16 over cp ranks, one micro-batch
    assert compute[1] - compute[0] == pytest.approx(grows * 4 * (1e-3 + tokens * width * 1e-9))


def test_context_parallel_extra_is_recomputed_under_checkpointing(tmp_path):
    """Activation checkpointing runs each block's forward again: a third of the cp extra (forward's
    share of forward + backward) lands in the recompute term."""
    cp = ("parallel.strategy=none", "parallel.cp=2", "parallel.activation_checkpointing=true")
    priced = dataclasses.replace(_base(), cp_ring_overhead=1e-3)
    terms = [{t.name: t.seconds for t in _plan(tmp_path, hw, *cp).time.terms} for hw in (_base(), priced)]
    assert terms[1]["compute"] - terms[0]["compute"] == pytest.approx(4 * 1e-3)
    assert terms[1]["recompute"] - terms[0]["recompute"] == pytest.approx(4 * 1e-3 / 3)


@pytest.mark.parametrize("vocab", [False, True])
def test_sequence_parallel_gathers_run_at_the_backends_all_gather_rates(tmp_path, vocab):
    """DTensor's Shard(1) -> Replicate under sequence parallelism calls the same all_gather_into_tensor
    the calibration times as gloo's all-gather: those calls at the hardware's gather_link, its other
    calls (reduce-scatters, the small all-reduces) at the link's. TINY, tp 2, one micro-batch of
    8 x 16 tokens, 4 blocks: per block 2 gathers of a LayerNorm output forward and 2 of a Linear
    output's gradient backward, + the embedding's gradient and the head's input."""
    sp = ("parallel.strategy=none", "parallel.tp=2", "parallel.sequence_parallel=true",
          f"parallel.tp_vocab_parallel={str(vocab).lower()}")
    own = dataclasses.replace(_base(), gather_link=Link(2e8, 5e-3))
    priced, plain = (_plan(tmp_path, hw, *sp) for hw in (own, _base()))
    c = next(c for c in priced.collectives if c.kind == "tp")
    assert c.gather_calls == 4 * 4 + 2 and c.gather_bytes == c.gather_calls * 8 * 16 * 32 * 4 // 2
    tp = [{t.name: t.seconds for t in p.time.terms}["tp tp (intra-node)"] for p in (priced, plain)]
    assert tp[0] - tp[1] == pytest.approx(c.gather_calls * (5e-3 - FAR) + c.gather_bytes * (1 / 2e8 - 1 / 1e9))
    tp2 = ("parallel.strategy=none", "parallel.tp=2")
    assert _plan(tmp_path, own, *tp2).time.step_s == _plan(tmp_path, _base(), *tp2).time.step_s  # all-reduces


@pytest.mark.parametrize("world, overrides, dtensors", [
    (2, ("parallel.strategy=ddp",), False), (2, ("parallel.strategy=zero", "parallel.zero_stage=2"), False),
    (2, ("parallel.strategy=fsdp",), True), (2, ("parallel.strategy=none", "parallel.tp=2"), True),
    (2, ("parallel.strategy=none", "parallel.tp=2", "parallel.sequence_parallel=true"), True),
    (4, ("parallel.strategy=fsdp", "parallel.tp=2"), True)])
def test_the_fused_optimizer_pays_a_dispatch_per_tensor_where_parameters_are_dtensors(tmp_path, world, overrides,
                                                                                       dtensors):
    """AdamW runs fused on every layout (tensor parallelism's mix of DTensors and plain tensors in
    one call per kind, parallel/adamw.py): FSDP2's and tp's ranks pay dtensor_optimizer_overhead
    per parameter tensor they step; plain layouts (ddp, ZeRO-1/2's flat slices) pay none."""
    base = _base()
    priced = dataclasses.replace(base, devices_per_node=world, dtensor_optimizer_overhead=1e-4)
    base = dataclasses.replace(base, devices_per_node=world)
    cfg = load_config(None, TINY + [f"trainer.run_dir={tmp_path}", "trainer.micro_batch_size=0", *overrides])
    g, lay = planner.gpt_config(cfg, 65), planner.check_layout(cfg, world)
    plans = [planner.plan_layout(cfg, g, lay, True, None, hw) for hw in (base, priced)]
    optimizer = [{t.name: t.seconds for t in p.time.terms}["optimizer"] for p in plans]
    tensors = len(list(GPT(g).parameters()))  # every rank steps a piece of every tensor
    assert optimizer[1] - optimizer[0] == pytest.approx(tensors * 1e-4 if dtensors else 0.0)


@pytest.mark.parametrize("overrides, kept, gathers", [
    (("parallel.dp_replicate=2",), "all-reduce dp_replicate", "all-gather dp_shard"),
    (("parallel.tp=2",), "tp tp", "all-gather dp")])
def test_the_fsdp_call_floor_leaves_hsdps_all_reduce_and_tps_collectives_alone(tmp_path, overrides, kept, gathers):
    """Under fsdp on 4 ranks, HSDP's all-reduce of the shards across replica groups and tensor
    parallelism's collectives keep their price with a floor above theirs: only FSDP2's own
    gathers and reduce-scatters are floored."""
    cfg = load_config(None, TINY + [f"trainer.run_dir={tmp_path}", "trainer.micro_batch_size=0",
                                    "parallel.strategy=fsdp", *overrides])
    base = dataclasses.replace(_base(), devices_per_node=4, gather_link=Link(1e9, 2e-4), scatter_link=Link(1e9, 2e-4))

    def terms(hw):
        lp = planner.plan_layout(cfg, planner.gpt_config(cfg, 65), planner.check_layout(cfg, 4), True, None, hw)
        return {t.name.split(" (")[0]: t.seconds for t in lp.time.terms}
    plain, floored = terms(base), terms(dataclasses.replace(base, fsdp_call_latency=5e-3))
    assert kept in plain and floored[kept] == plain[kept]
    assert floored[gathers] > plain[gathers]
