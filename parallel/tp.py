"""Tensor parallelism (parallel.tp): the Megatron layout on every block, built on DTensor styles.

Owns `apply_tensor_parallel(model, tp_mesh, vocab_parallel, sequence_parallel)`, which rewrites a
GPT (or a pipeline stage of one: any top-level piece may be None) in place for the `tp` mesh
dimension. Per block (Megatron-LM, Shoeybi et al. 2019, section 3):

    attention: q_proj, k_proj, v_proj column-parallel  -> each rank holds n_head / tp whole heads
               out_proj row-parallel                   -> one all-reduce of (B, T, C) in forward
    MLP:       fc column-parallel, proj row-parallel   -> one all-reduce in forward
    backward:  the mirror image, one all-reduce per attention and per MLP (on the block input).

q, k and v are separate Linear layers in model.py, so a column split hands every rank whole heads
of each (a fused [3C, C] layer split column-wise over tp=2 would give rank 0 all of q and half
of k). The attention code reshapes with view(b, t, -1, head_dim), so it runs on the local heads
unchanged.

Embedding and LM head: replicated by default (every tp rank holds the full matrices and computes
the full logits). With `vocab_parallel` both are sharded over the vocabulary (Shard(0) of the
[V, C] matrix): the embedding is row-parallel (a masked lookup + all-reduce) and the LM head is
column-parallel with logits left sharded on the vocabulary, so the cross-entropy must run under
`torch.distributed.tensor.parallel.loss_parallel()` (parallel/step.py loss_context does that). A tied
weight is re-tied after sharding (parallelize_module registers new Parameter objects).

With `sequence_parallel` (Korthikanti et al. 2022) the residual stream between the attention/MLP
regions is sharded over the sequence (Shard(1)): LayerNorm and dropout run on T / tp positions,
the all-reduce after each row-parallel layer becomes a reduce-scatter and an all-gather runs
before each column-parallel region (same bytes, 1/tp of the activation memory in those regions).
The residual stream stays a plain local tensor of shape (B, T / tp, C) between modules (a
Tensor + DTensor add fails in torch 2.13), which is also what a pipeline stage sends to the next one.

Parameters that no style touches (LayerNorms without sequence parallel, position embedding, a
replicated embedding/LM head) stay plain tensors, identical on every tp rank because their
inputs and gradients are replicated. The optimizer and gradient clipping handle the mix of
DTensor and plain parameters (see Strategy.adamw and Strategy.clip_grad_norm_).
"""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from model import GPT


def block_plan(sequence_parallel: bool) -> dict:
    """The parallelize_module plan of one transformer Block (keys are paths inside the block)."""
    # Layout of the residual stream that the row-parallel layers hand back: replicated (after an
    # all-reduce), or sequence-sharded (after a reduce-scatter) with sequence parallelism.
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.out_proj": RowwiseParallel(output_layouts=residual),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        # LayerNorm on the local sequence shard (its weight becomes a Replicate DTensor whose
        # gradient DTensor sums over the tp ranks); its output stays a Shard(1) DTensor, and the
        # attention / MLP input is all-gathered to the full sequence before the column split.
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"ln_1": SequenceParallel(), "attn": gather,
                     "ln_2": SequenceParallel(), "mlp": gather})
    return plan


def top_level_plan(model: GPT, vocab_parallel: bool, sequence_parallel: bool) -> dict:
    """Plan of the embeddings, final LayerNorm and LM head (only the pieces this model holds)."""
    plan = {}
    if model.tok_emb is not None and vocab_parallel:
        # Row-parallel embedding: each rank looks up its vocabulary rows (zeros elsewhere), an
        # all-reduce sums them; the output is the full (B, T, C) as a plain tensor.
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.drop is not None and sequence_parallel:
        # Enter the sequence-parallel region: the (replicated) embedding sum is split over the
        # sequence locally (no communication) before dropout and block 0.
        plan["drop"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                          use_local_output=True)
    if model.ln_f is not None and sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    if model.lm_head is not None:
        head_input = Shard(1) if sequence_parallel else Replicate()
        if vocab_parallel:
            # Logits stay sharded over the vocabulary: loss_parallel computes the cross-entropy
            # without gathering the (B, T, V) logits.
            plan["lm_head"] = ColwiseParallel(input_layouts=head_input, output_layouts=Shard(-1),
                                              use_local_output=False)
        elif sequence_parallel:
            # Replicated head: gather the sequence, then every rank computes the full logits.
            plan["lm_head"] = PrepareModuleInput(input_layouts=(head_input,),
                                                 desired_input_layouts=(Replicate(),),
                                                 use_local_output=True)
    return plan


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, vocab_parallel: bool = False,
                          sequence_parallel: bool = False) -> GPT:
    """Shard `model` (a whole GPT or one pipeline stage) over `tp_mesh` in place; returns it."""
    tied = (model.tok_emb is not None and model.lm_head is not None
            and model.lm_head.weight is model.tok_emb.weight)
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    plan = top_level_plan(model, vocab_parallel, sequence_parallel)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied and model.lm_head.weight is not model.tok_emb.weight:
        # Both were sharded the same way (Shard(0) of [V, C] on the same mesh): share one.
        model.lm_head.weight = model.tok_emb.weight
    return model
