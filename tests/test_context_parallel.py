"""Context parallelism (parallel/cp.py) in this process: the log-sum-exp merge, the load-balanced
split, ring attention and a whole GPT over N simulated ranks (threads passing tensors through
queues in place of the process group's point-to-point ops) against plain causal attention and one
model on the whole sequence; and the config and layout refusals, one line each.

The parity of real launches (gloo, DDP over dp x cp, the Trainer) is in tests/test_tp_pp.py's
multi-process fixtures (the cp cases)."""
from __future__ import annotations

import copy
import queue
import threading

import pytest
import torch
import torch.nn.functional as F

import main as app
from checks import load_config
from config import UsageError
from model import GPT, GPTConfig, lm_loss
from parallel import cp as cpmod
from parallel.layout import Layout
from testing.local import TINY

ATOL = 2e-6  # fp32: the ring sums the same terms as one softmax, in another order


class ThreadRing:
    """cp.Ring for N threads of one process: a queue per (receiving rank, tag) for the ring, a
    shared table and a barrier for all-gather and reduce-scatter."""

    def __init__(self, rank: int, size: int, boxes: dict):
        self.rank, self.size, self.boxes = rank, size, boxes

    def start_shift(self, tensors, tag):
        self.boxes[(self.rank + 1) % self.size, tag].put([t.clone() for t in tensors])
        return lambda: self.boxes[self.rank, tag].get(timeout=30)

    def _everyone(self, t):
        table, barrier = self.boxes["table"], self.boxes["barrier"]
        table[self.rank] = t.clone()
        barrier.wait()
        every = list(table)
        barrier.wait()  # nobody writes the next call's entry before all have read this one's
        return every

    def all_gather(self, t):
        return torch.stack(self._everyone(t))

    def reduce_scatter(self, t):
        return sum(x[self.rank] for x in self._everyone(t))


def run_ranks(n: int, body):
    """body(rank, ring) on n threads at once; their results in rank order (a failure re-raised)."""
    boxes = {(r, tag): queue.Queue() for r in range(n) for tag in (cpmod.KV_TAG, cpmod.DKV_TAG)}
    boxes.update(table=[None] * n, barrier=threading.Barrier(n, timeout=30))
    results, errors = [None] * n, []

    def target(r):
        try:
            results[r] = body(r, ThreadRing(r, n, boxes))
        except BaseException as e:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def test_the_split_covers_every_position_once_and_balances_causal_work():
    t = 32
    for cp in (1, 2, 4, 8):
        held = [cpmod.local_positions(t, r, cp) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(t))
        # causal work of a rank: for each query it holds, the keys at or before it
        work = [int((pos + 1).sum()) for pos in held]
        assert len(set(work)) == 1, (cp, work)  # equal on every rank
        x = torch.arange(t)[None, :].repeat(2, 1)
        assert torch.equal(cpmod.shard_sequence(x, cp - 1, cp)[0], held[-1])


@pytest.mark.parametrize("kernel", ["flash_cpu", "math"])
def test_merging_two_key_sets_by_log_sum_exp_is_attention_over_their_union(kernel):
    block = cpmod.flash_cpu_block if kernel == "flash_cpu" else cpmod.math_block
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    out, lse = (t.clone() for t in block(q, k[:, :, :5], v[:, :, :5], False))
    cpmod.merge(out, lse, *block(q, k[:, :, 5:], v[:, :, 5:], False))
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() < ATOL
    assert (lse - torch.logsumexp(q @ k.transpose(-2, -1) / 2.0, -1)).abs().max() < ATOL
    # and a merge with a block whose scores are far larger does not overflow
    out2, lse2 = (t.clone() for t in block(q, k, v, False))
    cpmod.merge(out2, lse2, *block(q * 60, k, v, False))
    assert torch.isfinite(out2).all()


def test_math_kernel_equals_the_fused_one_forward_and_backward():
    torch.manual_seed(1)
    q, k, v, dout = (torch.randn(2, 2, 6, 4) for _ in range(4))
    for causal in (True, False):
        fo, fl = cpmod.flash_cpu_block(q, k, v, causal)
        mo, ml = cpmod.math_block(q, k, v, causal)
        assert (fo - mo).abs().max() < ATOL and (fl - ml).abs().max() < ATOL
        for a, b in zip(cpmod.flash_cpu_block_backward(dout, q, k, v, fo, fl, causal),
                        cpmod.math_block_backward(dout, q, k, v, fo, fl, causal)):
            assert (a - b).abs().max() < ATOL


def test_math_kernel_in_bf16_keeps_fp32_statistics_and_matches_the_fused_one():
    """The GPU's block kernels under bf16 autocast (q, k, v in bf16; the softmax's statistics in
    fp32, as the fused kernel keeps them): forward and backward within bf16's rounding of the fused
    CPU kernel's. A GPU found the backward multiplying fp32 by bf16 (a dtype error)."""
    torch.manual_seed(1)
    q, k, v, dout = (torch.randn(2, 2, 16, 8).bfloat16() for _ in range(4))
    for causal in (True, False):
        fo, fl = cpmod.flash_cpu_block(q, k, v, causal)
        mo, ml = cpmod.math_block(q, k, v, causal)
        assert mo.dtype == torch.bfloat16 and ml.dtype == torch.float32
        assert (fo.float() - mo.float()).abs().max() < 2e-2 and (fl.float() - ml).abs().max() < 1e-2
        fused = cpmod.flash_cpu_block_backward(dout, q, k, v, fo, fl, causal)
        plain = cpmod.math_block_backward(dout, q, k, v, mo, ml, causal)
        for a, b in zip(fused, plain):
            assert b.dtype == torch.bfloat16 and (a.float() - b.float()).abs().max() < 5e-2


@pytest.mark.parametrize("mode", list(cpmod.ATTENTION))
@pytest.mark.parametrize("cp,kernel", [(2, "flash_cpu"), (4, "flash_cpu"), (3, "math")])
def test_cp_attention_equals_causal_attention_with_its_gradients(cp, kernel, mode, monkeypatch):
    if kernel == "math":
        monkeypatch.setattr(cpmod, "kernels", lambda device: (cpmod.math_block, cpmod.math_block_backward))
    torch.manual_seed(2)
    t = 4 * cp
    q, k, v, dout = (torch.randn(2, 3, t, 8) for _ in range(4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(dout)

    def rank(r, ring):
        pos = cpmod.local_positions(t, r, cp)
        mine = [x[:, :, pos].clone().requires_grad_() for x in (q, k, v)]
        out = cpmod.ATTENTION[mode](*mine, ring)
        out.backward(dout[:, :, pos])
        return pos, out.detach(), [x.grad for x in mine]
    for pos, out, grads in run_ranks(cp, rank):
        assert (out - ref.detach()[:, :, pos]).abs().max() < ATOL
        for g, x in zip(grads, full):
            assert (g - x.grad[:, :, pos]).abs().max() < ATOL


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0), seed=3)


@pytest.mark.parametrize("mode", list(cpmod.ATTENTION))
@pytest.mark.parametrize("cp", [2, 4])
def test_a_gpt_over_cp_ranks_has_one_models_loss_and_gradients(cp, mode):
    """Each rank: its tokens at their global positions, the mean loss over them; the cp ranks' mean
    loss and mean gradient are one model's on the whole sequences (what the runner and DDP compute)."""
    torch.manual_seed(4)
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    one = tiny_gpt()
    ref_loss = lm_loss(one(x), y)
    ref_loss.backward()

    def rank(r, ring):
        model = copy.deepcopy(one)
        model.zero_grad()
        for block in model.blocks.values():
            block.attn.context_parallel = lambda q, k, v: cpmod.ATTENTION[mode](q, k, v, ring)
        pos = cpmod.local_positions(16, r, cp)
        loss = lm_loss(model(cpmod.shard_sequence(x, r, cp), positions=pos), cpmod.shard_sequence(y, r, cp))
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}
    results = run_ranks(cp, rank)
    assert abs(sum(loss for loss, _ in results) / cp - ref_loss.item()) < 1e-6
    for name, p in one.named_parameters():
        mean = sum(grads[name] for _, grads in results) / cp
        assert (mean - p.grad).abs().max() < 1e-6, name
    # a token read at its local position instead of its global one is another model
    def local_pos(r, ring):
        model = copy.deepcopy(one)
        for block in model.blocks.values():
            block.attn.context_parallel = lambda q, k, v: cpmod.ATTENTION[mode](q, k, v, ring)
        return lm_loss(model(cpmod.shard_sequence(x, r, cp)), cpmod.shard_sequence(y, r, cp)).item()
    assert abs(sum(run_ranks(cp, local_pos)) / cp - ref_loss.item()) > 1e-4


# ----------------------------------------------------------------------------- refusals


def cfg_of(*overrides: str, world: int | None = None):
    return load_config(None, TINY + list(overrides), world_size=world)


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.cp=0"], "parallel.cp must be > 0"),
    (["parallel.cp=2", "parallel.cp_mode=ulysses"], "parallel.cp_mode='ulysses' is not one of ring, allgather"),
    (["parallel.cp_mode=ring2"], "parallel.cp_mode='ring2'"),
    (["parallel.cp=3"], "model.block_size=16 is not divisible by 2 x parallel.cp = 6"),
    (["parallel.cp=2", "model.dropout=0.1"], "parallel.cp needs model.dropout=0"),
    (["parallel.cp=2", "trainer.attention=matmul"], "parallel.cp computes attention in its own ring"),
    (["parallel.cp=2", "parallel.strategy=dp"], "nn.DataParallel"),
    (["parallel.cp=2", "parallel.strategy=auto"], "parallel.strategy=none or ddp or fsdp so far, not 'auto'"),
    (["parallel.cp=2", "parallel.strategy=fsdp", "parallel.mixed_precision=bf16"], "parallel.mixed_precision=none"),
    (["parallel.cp=2", "parallel.strategy=fsdp", "parallel.dp_replicate=2"], "parallel.dp_replicate=1"),
    (["parallel.cp=2", "parallel.strategy=zero"], "not 'zero'"),
    (["parallel.cp=2", "parallel.strategy=fsdp", "parallel.cpu_offload=true"], "no test holds the two together"),
    (["parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "model.block_size=12"],
     "each cp rank's 6 tokens (block / cp) is not divisible by parallel.tp=4"),
])
def test_bad_cp_configs_are_one_line(overrides, needle):
    with pytest.raises(UsageError) as e:
        cfg_of(*overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [["parallel.cp=3"], ["parallel.cp=2", "model.dropout=0.1"],
                                       ["parallel.cp=2", "parallel.strategy=dp"]])
def test_a_bad_cp_launch_is_one_line_exit_2_and_writes_nothing(overrides, tmp_path, capsys):
    run = tmp_path / "run"
    assert app.main([*TINY, *overrides, f"trainer.run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not run.exists()


def test_cp_layout_is_a_mesh_dimension_between_dp_and_tp():
    lay = Layout.of(cfg_of("parallel.cp=2"), 4)
    assert (lay.pp, lay.dp, lay.cp, lay.tp, lay.world_size, lay.grad_dim) == (1, 2, 2, 1, 4, "dp_cp")
    assert [(c.dp, c.cp) for c in map(lay.coordinate, range(4))] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(lay.rank_of(dp=c.dp, cp=c.cp) == r for r, c in enumerate(map(lay.coordinate, range(4))))
    assert lay.per_rank_batch == 4  # cp ranks of one dp rank read the same rows, each its tokens
    with pytest.raises(UsageError, match="not divisible by parallel.tp \\* parallel.pp \\* parallel.cp = 4"):
        cfg_of("parallel.cp=4", world=2)
    assert Layout.of(cfg_of(), 4).grad_dim == "dp"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ring_sends_the_bytes_its_formula_states(dtype):
    """What RingAttention hands to the ring per rank, forward and backward, against bytes_sent
    (in bf16: K/V travel in bf16, dK/dV in fp32)."""
    cp, b, h, d = 4, 2, 3, 8
    t = 4 * cp
    q, k, v = (torch.randn(b, h, t, d, dtype=dtype) for _ in range(3))
    sent = {}

    class CountingRing(ThreadRing):
        phase = "forward"

        def start_shift(self, tensors, tag):
            key = (self.rank, self.phase)
            sent[key] = sent.get(key, 0) + sum(x.numel() * x.element_size() for x in tensors)
            return super().start_shift(tensors, tag)

    def rank(r, ring):
        ring = CountingRing(ring.rank, ring.size, ring.boxes)
        pos = cpmod.local_positions(t, r, cp)
        mine = [x[:, :, pos].clone().requires_grad_() for x in (q, k, v)]
        out = cpmod.ring_attention(*mine, ring)
        ring.phase = "backward"
        out.sum().backward()
    run_ranks(cp, rank)
    want = cpmod.bytes_sent("ring", b, t // cp, h * d, cp, element_bytes=q.element_size())
    for r in range(cp):
        assert {p: sent[r, p] for p in ("forward", "backward")} == want
