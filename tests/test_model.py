"""model.py: causality, loss at init, weight tying, GPT-2 init, generate(),
and the FLOPs-per-token formula that MFU is computed from. All in-process, tiny models."""
from __future__ import annotations

import math

import pytest
import torch

from model import GPT, GPTConfig, lm_loss


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).eval()


def test_a_token_never_changes_earlier_logits():
    model = tiny(n_layer=3)
    x = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    base = model(x)
    for t in (0, 5, 15):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1) % 65
        out = model(x2)
        # positions before t read nothing of token t: bit-identical, not merely close
        assert torch.equal(out[:, :t], base[:, :t]), f"token {t} leaked into earlier positions"
        assert not torch.allclose(out[:, t], base[:, t]), "position t must see its own token"


@pytest.mark.parametrize("vocab", [65, 1000])
def test_loss_at_init_is_about_ln_vocab(vocab):
    model = tiny(vocab_size=vocab, n_embd=64)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, vocab, (8, 16), generator=g)
    y = torch.randint(0, vocab, (8, 16), generator=g)
    loss = lm_loss(model(x), y).item()
    assert abs(loss - math.log(vocab)) / math.log(vocab) < 0.03, (loss, math.log(vocab))


def test_tied_head_shares_one_tensor_and_untied_does_not():
    tied, untied = tiny(tie_weights=True), tiny(tie_weights=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    assert sum(1 for p in tied.parameters() if p is tied.tok_emb.weight) == 1  # listed once
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert untied.num_params() - tied.num_params() == 65 * 32
    # one gradient for the shared matrix: the sum of the embedding's and the head's
    x = torch.randint(0, 65, (2, 16))
    lm_loss(tied.train()(x), x).backward()
    assert tied.tok_emb.weight.grad is tied.lm_head.weight.grad


def test_gpt2_init_scales_residual_projections():
    n_layer = 6
    model = tiny(n_layer=n_layer, n_embd=256, n_head=4)
    residual = 0.02 / math.sqrt(2 * n_layer)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
            continue
        if p.dim() < 2:  # LayerNorm weight
            assert torch.all(p == 1), name
            continue
        want = residual if name.endswith(("attn.out_proj.weight", "mlp.proj.weight")) else 0.02
        got = p.std().item()
        assert abs(got - want) / want < 0.05, f"{name}: std {got:.5f}, want {want:.5f}"
        assert abs(p.mean().item()) < 0.1 * want, name


def test_generate_length_greedy_determinism_and_top_k():
    model = tiny()
    idx = torch.tensor([[1, 2, 3]])
    n = 40  # more than block_size: the context must be cropped to the last 16 tokens
    greedy = model.generate(idx, n, temperature=0.0)
    assert greedy.shape == (1, 3 + n) and torch.equal(greedy[:, :3], idx)
    assert torch.equal(greedy, model.generate(idx, n, temperature=0.0))
    # greedy by hand: argmax of the logits of the cropped context, one token at a time
    by_hand = idx
    for _ in range(n):
        nxt = model(by_hand[:, -16:])[:, -1].argmax(-1, keepdim=True)
        by_hand = torch.cat([by_hand, nxt], 1)
    assert torch.equal(greedy, by_hand)
    # top_k=1 is greedy whatever the temperature; a seeded generator repeats itself
    assert torch.equal(model.generate(idx, n, temperature=1.5, top_k=1), greedy)
    g1, g2 = (torch.Generator().manual_seed(7) for _ in range(2))
    a = model.generate(idx, n, temperature=1.0, top_k=5, generator=g1)
    assert torch.equal(a, model.generate(idx, n, temperature=1.0, top_k=5, generator=g2))
    # every sampled token is among the top 5 of its step's logits
    for t in range(3, 3 + n):
        logits = model(a[:, max(0, t - 16):t])[:, -1]
        assert a[0, t].item() in torch.topk(logits, 5).indices[0].tolist()


def test_flops_per_token_formula():
    v, l, c, t = 65, 4, 128, 64  # nanoGPT's CPU Shakespeare config
    per_block = 4 * (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c) + 2 * 2 * c  # attn, mlp, 2 LN
    n = v * c + l * per_block + 2 * c  # tied embedding once, blocks, ln_f; no position embedding
    want = 6 * n + 12 * l * c * t
    assert want == 5_203_200
    tied = GPT(GPTConfig(vocab_size=v, block_size=t, n_layer=l, n_head=4, n_embd=c))
    assert tied.num_params() == n
    assert tied.num_params(exclude_position=False) == n + t * c
    assert tied.flops_per_token() == want
    # untied: the input embedding is a lookup (no FLOPs), the head is the same matmul
    untied = GPT(GPTConfig(vocab_size=v, block_size=t, n_layer=l, n_head=4, n_embd=c, tie_weights=False))
    assert untied.flops_per_token() == want


def test_speedrun_options_compute_what_they_say():
    # relu2: proj(relu(fc(x))^2); qk_norm: q and k scaled to unit RMS per head before attention
    # (checked against attention written out); zero_init_proj: both output projections start at 0
    torch.manual_seed(0)
    g = GPTConfig(block_size=8, n_embd=16, n_head=2, activation="relu2", qk_norm=True, zero_init_proj=True)
    model = GPT(g)
    block = model.blocks["0"]
    assert block.attn.out_proj.weight.abs().sum() == 0 and block.mlp.proj.weight.abs().sum() == 0
    assert block.attn.q_proj.weight.abs().sum() > 0
    for p in (block.attn.out_proj.weight, block.mlp.proj.weight):
        torch.nn.init.normal_(p)
    x = torch.randn(2, 8, 16)
    mlp = block.mlp
    assert torch.allclose(mlp(x), mlp.proj(torch.relu(mlp.fc(x)) ** 2), atol=1e-6)
    attn = block.attn

    def heads(t):
        t = t.view(2, 8, 2, 8).transpose(1, 2)
        return t / t.pow(2).mean(-1, keepdim=True).add(torch.finfo(t.dtype).eps).sqrt()
    q, k = heads(attn.q_proj(x)), heads(attn.k_proj(x))
    v = attn.v_proj(x).view(2, 8, 2, 8).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(torch.ones(8, 8).triu(1).bool(), float("-inf"))
    want = attn.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 8, 16))
    assert torch.allclose(attn(x), want, atol=1e-5)


def test_matmul_attention_computes_the_fused_kernels_function():
    """trainer.attention=matmul (plain ops, T x T probabilities held) and sdpa give one function: the
    same logits and gradients within fp32 rounding, with qk_norm too, so snapshots move between them."""
    torch.manual_seed(0)
    fused = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32, qk_norm=True))
    plain = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32, qk_norm=True))
    plain.load_state_dict(fused.state_dict())
    for block in plain.blocks.values():
        block.attn.kernel = "matmul"
    x, y = torch.randint(0, 65, (3, 16)), torch.randint(0, 65, (3, 16))
    losses = []
    for model in (fused, plain):
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-6
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name

