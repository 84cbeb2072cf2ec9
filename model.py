"""The GPT-2-style decoder: one readable file, no parallelism in it.

Owns `GPTConfig`, the modules, GPT-2 initialisation, generation and the FLOP count for MFU.

Initialisation is one tensor at a time, each parameter from a generator of its own seeded from
(trainer.seed, the parameter's name) (`initial_tensor`): a rank that holds a slice of a parameter
(a pipeline stage, a tensor-parallel or FSDP shard) computes the whole tensor and keeps its slice,
so every layout starts from exactly the weights one process starts from, and no rank ever needs
the whole model at once (parallel/materialize.py builds it on the meta device and fills each
rank's share). The price: a rank generates every parameter it holds a slice of (under FSDP, all of
them), one at a time, on the CPU.
Two design choices exist for the parallel code in `parallel/`:
- q, k and v are three separate Linear layers, not one fused [3C, C] layer: a column-wise TP
  split of a fused layer would hand rank 0 all of q and half of k (silently wrong attention);
  split per layer, every TP rank gets whole heads of q, k and v.
- blocks live in a ModuleDict keyed "0".."L-1", and every top-level piece may be None: a pipeline
  stage deletes what it does not own and keeps the same fully-qualified parameter names
  ("blocks.3.attn.q_proj.weight"), so snapshots and parity checks line up across layouts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from config import ModelShape


@dataclass
class GPTConfig(ModelShape):
    """The model's shape (config.ModelShape: block size, depth, width, heads, dropout, bias, tied
    head, GELU form, the speedruns' options) and its vocabulary."""
    vocab_size: int = 65

    @classmethod
    def of(cls, model_cfg, vocab_size: int) -> "GPTConfig":
        """The shape a config's `model` section (config.ModelConfig) gives with this vocabulary (the
        section's other keys, e.g. init_from, are not shape)."""
        return cls(vocab_size=vocab_size, **{f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(ModelShape)})


@dataclass(frozen=True)
class ModelCost:
    """What the whole model costs: the start-up view shows its parameters, MFU divides by its FLOPs."""
    num_params: int  # every unique parameter, position embeddings included
    flops_per_token: float  # training FLOPs per token (GPT.flops_per_token)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of (B, heads, T, head_dim) inputs in torch's fused kernel (`sdpa`: flash on a
    CPU; flash, memory-efficient or cuDNN on a GPU), which never holds the (T, T) scores. On a CPU
    in bf16 prefer matmul_attention for short sequences: torch 2.13's CPU flash backward in bf16
    took 2.8x its fp32 time (3.73 vs 1.34 ms forward + backward at 12 x 4 heads x 64 tokens x 32,
    2 threads, an EPYC with avx512_bf16; benchmarks/fast_preset_variants.py, 2026-11-27)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """The same attention in plain ops (`trainer.attention=matmul`): softmax(q k^T / sqrt(d), causal)
    v, holding every head's (T, T) probabilities for backward: B x heads x T^2 elements a block,
    where the fused kernel holds B x heads x T. Faster on a CPU for short sequences, where the fused
    kernel's blocking costs more than the scores (nanoGPT's CPU model, T = 64, forward + backward of
    a layer's attention: 1.11 vs 1.34 ms in fp32, 1.08 vs 3.73 ms in bf16; benchmarks/fast_preset_variants.py).
    q is scaled before the product so fp16 scores stay in range; the softmax runs in fp32. The same
    function as the fused kernel in fp32; under bf16/fp16 autocast the scores leave the product
    rounded to 16 bits before the fp32 softmax, where the fused kernels keep them in fp32."""
    t = q.size(-2)
    scores = (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    probs = scores.float().softmax(dim=-1).to(v.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        c = cfg.n_embd
        self.head_dim = c // cfg.n_head
        self.q_proj = nn.Linear(c, c, bias=cfg.bias)
        self.k_proj = nn.Linear(c, c, bias=cfg.bias)
        self.v_proj = nn.Linear(c, c, bias=cfg.bias)
        self.out_proj = nn.Linear(c, c, bias=cfg.bias)
        self.out_proj.residual_scale = True  # GPT-2 init: std / sqrt(2 * n_layer)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.qk_norm = cfg.qk_norm
        # Context parallelism (parallel/cp.py) sets this to its attention over the ranks that hold
        # the other pieces of each sequence: (q, k, v) -> y, causal by global position. An
        # attribute, not a submodule: parameter names stay the same with it on or off.
        self.context_parallel = None
        # trainer.attention (parallel/parallelize.py sets it): which kernel computes attention; both
        # compute the same function, so snapshots move freely between them.
        self.kernel = "sdpa"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (B, T, C) -> (B, heads, T, head_dim). "-1" heads: under TP a rank holds n_head / tp heads.
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm:  # over head_dim: a head's own statistic, whichever rank holds the head
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        if self.context_parallel is not None:  # this rank holds only some of each sequence's tokens
            y = self.context_parallel(q, k, v)
        else:
            attend = matmul_attention if self.kernel == "matmul" else causal_attention
            y = attend(q, k, v, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.out_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_scale = True
        self.drop = nn.Dropout(cfg.dropout)
        self.gelu_approximate = "tanh" if cfg.gelu == "tanh" else "none"
        self.relu2 = cfg.activation == "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate=self.gelu_approximate)
        return self.drop(self.proj(h))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        # Activation checkpointing keeps only the block input and recomputes the rest in backward.
        # A flag (not a wrapper module) so parameter names stay the same with it on or off.
        self.activation_checkpointing = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        """`seed`: the initial weights' (trainer.seed; initial_tensor)."""
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        # Context parallelism (parallel/cp.py) sets this: (local length, device) -> the global
        # positions of the tokens this rank holds of each sequence. An attribute, as on attention.
        self.context_parallel_positions = None
        if not self.ln_f.weight.is_meta:  # built on the meta device: parallel/materialize.py fills it
            init_weights(self, seed)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V). A pipeline stage without the embedding takes
        hidden states (B, T, C) instead, and one without the head returns hidden states.
        `positions` (T,): each token's position in its sequence, when x holds only some of each
        sequence (context parallelism: parallel/cp.py sets `context_parallel_positions`, which
        gives them); by default 0..T-1."""
        if self.tok_emb is not None:
            x = self.embed(x, positions)
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x

    def embed(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Token ids (B, T) -> the embedded tokens at their positions (B, T, C). A method of its own so
        that a model compiled whole (trainer.compile_scope=model) keeps it eager: parallel/parallelize.py
        wraps it in torch.compiler.disable there."""
        if positions is None:
            cp = self.context_parallel_positions
            positions = torch.arange(x.size(1), device=x.device) if cp is None else cp(x.size(1), x.device)
        return self.drop(self.tok_emb(x) + self.pos_emb(positions))

    # ------------------------------------------------------------------ accounting

    def num_params(self, exclude_position: bool = True) -> int:
        """Unique parameters (a tied matrix counts once); position embeddings are excluded by
        default because they cost no matmul FLOPs (nanoGPT's convention)."""
        n = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if exclude_position and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matmuls of forward+backward, plus 12*L*C*T for
        attention scores and values (PaLM appendix B). An untied input embedding is a lookup,
        not a matmul, so it is left out of N."""
        c = self.cfg
        n = self.num_params()
        if not c.tie_weights:
            n -= c.vocab_size * c.n_embd
        return 6 * n + 12 * c.n_layer * c.n_embd * c.block_size

    def cost(self) -> "ModelCost":
        """Counted on the whole model, before any parallel split."""
        return ModelCost(num_params=self.num_params(exclude_position=False), flops_per_token=self.flops_per_token())

    # ------------------------------------------------------------------ sampling

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T); the context is cropped to block_size."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.block_size:]
            logits = self(ctx)[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k > 0:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx


# ----------------------------------------------------------------------------- initial weights


def stable_seed(seed: int, name: str) -> int:
    """A generator seed of (seed, name), the same in every process and Python (not the salted hash())."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def initial_tensor(model: nn.Module, name: str, seed: int) -> torch.Tensor:
    """The whole initial value (fp32, on the CPU) of `model`'s parameter `name`, a GPT or a pipeline
    stage of one (same names). GPT-2: N(0, 0.02) for embeddings and linear weights; the residual
    projections N(0, 0.02 / sqrt(2 L)), since each block adds two of them to the residual stream and
    its variance would grow with depth (zero with zero_init_proj); biases 0, LayerNorm weights 1. The
    tied head is the token embedding (one name, tok_emb.weight, even on a stage that holds only the head)."""
    cfg = model.cfg
    if cfg.tie_weights and name == "lm_head.weight":
        name = "tok_emb.weight"
    module_name, _, kind = name.rpartition(".")
    module = model.get_submodule("lm_head" if module_name == "tok_emb" and model.tok_emb is None else module_name)
    shape = tuple(getattr(module, kind).shape)
    if isinstance(module, nn.LayerNorm):
        return torch.ones(shape) if kind == "weight" else torch.zeros(shape)
    if kind == "bias":
        return torch.zeros(shape)
    residual = getattr(module, "residual_scale", False)
    if residual and cfg.zero_init_proj:
        return torch.zeros(shape)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=torch.Generator().manual_seed(stable_seed(seed, name)))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Every parameter of a whole (materialised, unsplit) model set to its initial_tensor."""
    for name, p in model.named_parameters():  # a tied tensor once, under its first name
        p.copy_(initial_tensor(model, name, seed))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits are upcast so bf16/fp16 runs reduce in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
