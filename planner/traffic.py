"""What tensor, pipeline and context parallelism move per optimizer step on one pipeline rank: the
activations tensor-parallel ranks exchange around every block (`tp_collective`), the activations
and their gradients crossing stage boundaries, and the tied embedding/head gradient reduced
between the first and the last stage (`pp_collectives`), the K/V blocks and their gradients the
cp ranks of a sequence exchange in every attention layer (`cp_collectives`). The data-parallel engines' traffic is
planner/engines.py's.

E = b s h elements of one micro-batch's (b, s, h) activation, e bytes each; per rank on a ring of
t ranks an all-reduce moves 2K(t-1)/t and an all-gather or reduce-scatter K(t-1)/t.
"""
from __future__ import annotations

from dataclasses import dataclass

from model import GPTConfig
from parallel.options import Engine
from planner.activations import ActivationModel
from planner.inventory import PARAM_BYTES, RankTensors
from planner.records import Collective, PlannedLayout
from planner.units import ceil_div


@dataclass
class TpCalls:
    """One micro-batch's tensor-parallel collectives of a (b, s, h) activation, by the dtype of
    what they carry: a Linear's output and the gradient of a Linear's output have the matmul
    dtype (16-bit under autocast); a Linear's input and its gradient have the residual stream's
    (fp32 under autocast: DTensor redistributes the fp32 LayerNorm output before autocast casts
    it inside the Linear, so the input gradient comes back through that cast in fp32)."""
    all_reduce_matmul: int
    all_reduce_residual: int
    gather_scatter_matmul: int  # all-gathers + reduce-scatters
    gather_scatter_residual: int
    scatter_matmul: int  # of those, reduce-scatters (the dispatcher's reduce_scatter_tensor calls)
    scatter_residual: int
    what: str

    @property
    def calls(self) -> int:
        return self.all_reduce_matmul + self.all_reduce_residual + self.gather_scatter_matmul + \
            self.gather_scatter_residual


def _tp_calls(lay: PlannedLayout, blocks: int, first: bool, last: bool) -> TpCalls:
    """The tensor-parallel collectives of one micro-batch on a pp rank with `blocks` blocks."""
    vocab = lay.tp_vocab_parallel
    if not lay.sequence_parallel:
        # forward: the row-parallel out_proj and mlp.proj outputs (matmul dtype); backward: the
        # input gradient of each column-parallel Linear, q, k, v (three: parallel/tp.py shards
        # them separately) and fc (residual dtype): 6 all-reduces per block where Megatron's
        # fused qkv has 4; vocabulary-parallel: the embedding's output and the LM head's input
        # gradient, both residual (measured: benchmarks/strategy_report.py, and their dtypes by
        # the dry run under bf16 autocast, tools/dry_run.py)
        # activation checkpointing: backward recomputes each block's forward up to its last saved
        # tensor (torch's non-reentrant checkpoint stops early), so out_proj's all-reduce again,
        # not proj's (found by the dry-run sweep)
        again = blocks if lay.activation_checkpointing else 0
        return TpCalls(2 * blocks + again, 4 * blocks + (vocab and first) + (vocab and last), 0, 0, 0, 0,
                       "all-reduce of (b, s, h): out_proj and proj outputs, q/k/v and fc input gradients")
    # per block an all-gather of the LayerNorm output before attention and MLP (residual) and a
    # reduce-scatter of their Linear output after them (matmul), mirrored in backward (the
    # gathers' backward reduce-scatters residual gradients, the scatters' backward gathers matmul
    # ones): 8; the first stage gathers the embedding's gradient (dropout's Replicate ->
    # Shard(1)), the last gathers the head input (vocabulary-parallel: and reduce-scatters its
    # gradient), all residual; vocabulary-parallel embedding: 1 all-reduce of its output
    ends = first + last + (vocab and last)
    # activation checkpointing: the recomputed forward gathers both LayerNorm outputs again and
    # reduce-scatters attention's output, but stops before the MLP's reduce-scatter (its output
    # is not saved): + 2 residual gathers and 1 matmul scatter per block
    again = blocks if lay.activation_checkpointing else 0
    return TpCalls(0, int(vocab and first), 4 * blocks + again, 4 * blocks + ends + 2 * again, 2 * blocks + again,
                   2 * blocks + (vocab and last),
                   "all-gather + reduce-scatter of (b, s, h) around attention and MLP, forward and backward")


def tp_collective(g: GPTConfig, lay: PlannedLayout, am: ActivationModel, held: RankTensors,
                  stages: list[int]) -> Collective:
    """Every tensor-parallel collective of one step on this pp rank, as one record (kind "tp")."""
    tp, m, b = lay.tp, lay.microbatches, lay.micro_batch_size
    s = g.block_size // lay.cp  # cp: this rank's tokens of each sequence
    act_m, act_r = (b * s * g.n_embd * e for e in (am.matmul, am.residual))
    first, last = 0 in stages, lay.num_stages - 1 in stages
    c = _tp_calls(lay, held.blocks, first, last)
    # loss_parallel: the max, the sum of exponentials and the target logit over the vocabulary
    small = 3 * b * s * 4 if lay.tp_vocab_parallel and last else 0
    # sequence parallel: LayerNorm gradients come out of backward as Partial DTensors (each
    # rank saw T / tp positions); Strategy.forward_backward all-reduces them once
    # (parallel/dtensor.py settle_partial_grads)
    ln_grads = held.layer_norm_elems * PARAM_BYTES if lay.sequence_parallel else 0
    all_reduced = c.all_reduce_matmul * act_m + c.all_reduce_residual * act_r
    gathered = c.gather_scatter_matmul * act_m + c.gather_scatter_residual * act_r
    payload = (all_reduced + gathered + small) * m + ln_grads
    moved = round(((2 * all_reduced + gathered + 2 * small) * m + 2 * ln_grads) * (tp - 1) / tp)
    scattered = c.scatter_matmul * act_m + c.scatter_residual * act_r
    gather_calls = (c.gather_scatter_matmul - c.scatter_matmul + c.gather_scatter_residual - c.scatter_residual) * m
    return Collective("tp", "tp", c.what, payload, moved,
                      "m bsh e (t-1)/t x (12L, or 8L with sequence parallel, + ends) + LayerNorm grads; "
                      "e: matmul dtype for Linear outputs, residual for Linear inputs",
                      calls=(c.calls + (3 if small else 0)) * m + (1 if ln_grads else 0),
                      reduce_scatter_calls=(c.scatter_matmul + c.scatter_residual) * m,
                      reduce_scatter_bytes=round(scattered * m * (tp - 1) / tp),
                      gather_calls=gather_calls, gather_bytes=round((gathered - scattered) * m * (tp - 1) / tp))


def pp_collectives(g: GPTConfig, lay: PlannedLayout, am: ActivationModel, stages: list[int]) -> list[Collective]:
    """Stage boundaries: E per boundary per micro-batch forward (activations) and backward (their
    gradients); a tied embedding/head split over two ranks: its gradient all-reduced, 2K(2-1)/2 = K."""
    tp, m, last = lay.tp, lay.microbatches, lay.num_stages - 1
    s = g.block_size // lay.cp  # cp: this rank's tokens of each sequence
    e = lay.micro_batch_size * s * g.n_embd * am.residual // (tp if lay.sequence_parallel else 1)
    # a boundary between two stages of one rank (ZB-V's middle) is a local hand-over, no p2p
    where = lay.stage_placement
    sends = sum((s < last and where[s + 1] != where[s]) + (s > 0 and where[s - 1] != where[s]) for s in stages)
    out = [Collective("send-recv", "pp", "activations forward and their gradients backward, per micro-batch",
                      sends * e * m, sends * e * m, "m x (b s h e) per stage boundary", calls=sends * m)]
    if g.tie_weights and (0 in stages) != (last in stages):
        vloc = ceil_div(g.vocab_size, tp if lay.tp_vocab_parallel else 1)
        if lay.strategy in (Engine.FSDP, Engine.ZERO3) and lay.dp_shard > 1:
            # parallel/pp.py all-reduces the local gradient: under FSDP2 that is the dp shard
            # (found by the dry run: tools/dry_run.py)
            vloc = ceil_div(vloc, lay.dp_shard)
        kt = vloc * g.n_embd * PARAM_BYTES
        out.append(Collective("all-reduce", "tied", "tied embedding/head gradient, first + last stage",
                              kt, kt, "2K(2-1)/2"))
    return out


def cp_collectives(g: GPTConfig, lay: PlannedLayout, am: ActivationModel, held: RankTensors) -> list[Collective]:
    """Context parallelism (parallel/cp.py), per layer and micro-batch on one rank of a ring of n = cp.
    The K and V of this rank's s/n tokens are a = 2 b (s/n) (h/tp) e bytes (e: the matmul dtype;
    tp: this rank's heads); their gradients g = 2 b (s/n) (h/tp) 4 (dK/dV are summed and sent in fp32).
      ring:      forward n-1 K/V sends (a each), backward n-1 K/V sends again + n dK/dV sends (the
                 last one home): (2n-2) a + n g, one batch_isend_irecv per shift, 3n-2 shifts
      allgather: forward one all-gather of every rank's K/V (payload n a), backward one
                 reduce-scatter of the dK/dV of the whole sequence (payload n g): (n-1)(a + g)
    and under activation checkpointing backward reruns the forward's: another (n-1) a (one more
    all-gather, or n-1 more shifts). x blocks x m. Without a data-parallel engine (strategy none)
    the runner all-reduces every gradient over cp once per step, after its micro-batches
    (ContextParallelLoop): 2K(n-1)/n."""
    n, m, blocks = lay.cp, lay.microbatches, held.blocks
    tokens_width = lay.micro_batch_size * (g.block_size // n) * (g.n_embd // lay.tp)
    a, grad = 2 * tokens_width * am.matmul, 2 * tokens_width * 4
    forwards = 2 if lay.activation_checkpointing else 1
    if lay.cp_mode == "allgather":
        payload, moved, calls = forwards * n * a + n * grad, (n - 1) * (forwards * a + grad), forwards + 1
        what, formula = "all-gather of K/V forward, reduce-scatter of dK/dV backward, per layer", "m L (n-1)(a+g)"
    else:
        payload = moved = (n - 1) * forwards * a + (n - 1) * a + n * grad
        calls = (n - 1) * forwards + 2 * n - 1
        what, formula = "K/V around the ring forward and backward, dK/dV back to their owners, per layer", \
            "m L ((2n-2)a + n g)"
    if lay.activation_checkpointing:
        formula += " + m L (n-1)a recomputed"
    gathers = (forwards * blocks * m, (n - 1) * forwards * a * blocks * m) if lay.cp_mode == "allgather" else (0, 0)
    out = [Collective("cp", "cp", what, payload * blocks * m, moved * blocks * m,
                      formula + ", a = 2 b (s/n) (h/tp) e, g = 2 b (s/n) (h/tp) 4", calls=calls * blocks * m,
                      gather_calls=gathers[0], gather_bytes=gathers[1])]
    if lay.strategy is Engine.NONE:
        # the vocabulary-parallel embedding's gradient comes back whole on every tp rank
        # (docs/layouts.md), so the runner reduces V rows of it, not its V/tp; unless the head
        # is the same tensor (tied, one stage), whose gradient then holds the rank's rows
        one_tensor = g.tie_weights and lay.pp == 1
        whole_emb = sum((g.vocab_size - t.shape[0]) * g.n_embd for t in held
                        if t.spec.name == "tok_emb.weight" and t.shape[0] != g.vocab_size and not one_tensor)
        k = (held.elems + whole_emb) * PARAM_BYTES
        out.append(Collective("all-reduce", "cp", "gradients over cp once per step (no data-parallel engine)",
                              k, round(2 * k * (n - 1) / n), "2K(n-1)/n"))
    return out
