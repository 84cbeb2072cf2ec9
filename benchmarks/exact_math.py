"""What nanoGPT's CPU step costs beyond its math, and what each candidate change buys, in one process.

    python benchmarks/exact_math.py                # nanoGPT's CPU config, 2 threads
    python benchmarks/exact_math.py --rounds 12    # more interleaved rounds

Two measurements, both of model.py's GPT on nanoGPT's CPU config (4 x 4 x 128, block 64, batch 12,
no biases, fused AdamW, clip 1.0), fp32 throughout:

1. The floor: every matmul of one optimizer step timed alone at its own shape (per Linear: the
   forward x @ W^T, the backward's dX = dY @ W and dW = dY^T @ X; the tied head counted once
   per use) plus flash attention's forward and backward at (B, heads, T, head_dim). Their sum is
   what a step costs if nothing but the math ran, at the rate these shapes get alone.
2. Whole steps of candidate changes, one at a time, measured in interleaved rounds (every variant
   once per round, the median over rounds), so machine noise hits all of them alike:
   eager; torch.compile of the model; + q/k/v as one matmul (the three weights concatenated at
   run time); + clip and AdamW compiled into one graph; + the loss inside the compiled region;
   each block compiled on its own instead of the whole model (as torchtitan compiles); the model
   compiled with mode="max-autotune-no-cudagraphs" (inductor's C++ GEMM templates on a CPU).

A change is worth taking when it beats `compile` by more than the round-to-round spread printed.
The ratio that the tokens/s target compares, against nanoGPT's own eager `train.py`, is measured
side by side by benchmarks/vs_nanogpt.py; its eager step is within a few percent of `eager` here
(docs/performance.md), so the floor says how far any exact-math change can go.
"""
from __future__ import annotations

import argparse
import statistics
import time

import _repo  # noqa: F401  (the repository on sys.path)
import torch
import torch.nn as nn
import torch.nn.functional as F

from model import GPT, CausalSelfAttention, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False)
BATCH = 12
VARIANTS = ("eager", "compile", "compile+fused_qkv", "compile+compiled_optimizer", "compile+loss_in_graph",
            "compile_per_block", "compile_max_autotune")


def best_ms(fn, repeats: int = 200) -> float:
    """Best-of-`repeats` milliseconds of fn() after a warm-up: the rate a shape gets alone."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def matmul_floor_ms(model: GPT, tokens: int) -> tuple[float, float]:
    """(ms, GFLOP) of one step's matmuls, each timed alone: 3 per Linear use (forward, dX, dW)."""
    total_ms = flop = 0.0
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for lin in linears:
        out_f, in_f = lin.weight.shape
        x, w, dy = torch.randn(tokens, in_f), torch.randn(out_f, in_f), torch.randn(tokens, out_f)
        total_ms += best_ms(lambda: x @ w.t()) + best_ms(lambda: dy @ w) + best_ms(lambda: dy.t() @ x)
        flop += 3 * 2 * tokens * in_f * out_f
    return total_ms, flop / 1e9


def attention_floor_ms(cfg: GPTConfig, batch: int) -> float:
    """Flash attention forward + backward of every layer, timed alone."""
    shape = (batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    return cfg.n_layer * best_ms(fwd_bwd, repeats=100)


def fused_qkv_forward(self: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """q, k, v from one [3C, C] matmul of the three weights concatenated at run time."""
    b, t, _ = x.shape
    w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
    q, k, v = F.linear(x, w).view(b, t, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


def make_step(variant: str, data: torch.Tensor):
    """One optimizer step of `variant` on batch i of `data` (the same batches for every variant)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if "fused_qkv" in variant:
        for m in model.modules():
            if isinstance(m, CausalSelfAttention):
                m.forward = fused_qkv_forward.__get__(m)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=True)
    if variant == "compile_per_block":
        for block in model.blocks.values():
            block.compile()  # in place: the block's forward compiled, the model around it eager
    mode = "max-autotune-no-cudagraphs" if variant == "compile_max_autotune" else None
    whole = variant.startswith("compile") and variant != "compile_per_block"
    forward = torch.compile(model, mode=mode) if whole else model
    loss_of = (torch.compile(lambda x, y: lm_loss(model(x), y)) if "loss_in_graph" in variant
               else lambda x, y: lm_loss(forward(x), y))

    def clip_and_step():
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    update = torch.compile(clip_and_step) if "compiled_optimizer" in variant else clip_and_step

    def step(i: int) -> None:
        batch = data[(i * BATCH) % (len(data) - BATCH):][:BATCH]
        loss_of(batch[:, :-1], batch[:, 1:]).backward()
        update()
        opt.zero_grad(set_to_none=True)
    return step


def time_variants(rounds: int, steps_per_round: int) -> dict[str, list[float]]:
    data = torch.randint(0, CONFIG.vocab_size, (BATCH * 50, CONFIG.block_size + 1))
    steps = {v: make_step(v, data) for v in VARIANTS}
    for v, step in steps.items():  # warm-up, compiles included
        print(f"  warming up {v}", flush=True)
        for i in range(15):
            step(i)
    times = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v, step in steps.items():
            t = time.perf_counter()
            for i in range(steps_per_round):
                step(i)
            times[v].append(1e3 * (time.perf_counter() - t) / steps_per_round)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2, nanoGPT's CPU runs here)")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default: 8)")
    ap.add_argument("--steps", type=int, default=25, help="steps per variant per round (default: 25)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens = BATCH * CONFIG.block_size
    mm_ms, gflop = matmul_floor_ms(GPT(CONFIG), tokens)
    attn_ms = attention_floor_ms(CONFIG, BATCH)
    print(f"threads {torch.get_num_threads()} | torch {torch.__version__}")
    print(f"floor: matmuls {mm_ms:.2f} ms ({gflop:.2f} GFLOP at {1e3 * gflop / mm_ms:.0f} GFLOP/s alone) "
          f"+ flash attention {attn_ms:.2f} ms = {mm_ms + attn_ms:.2f} ms per step", flush=True)
    times = time_variants(args.rounds, args.steps)
    eager = statistics.median(times["eager"])
    print(f"{'variant':28s} {'median ms/step':>15s} {'spread':>14s} {'vs eager':>9s} {'floor share':>12s}")
    for v in VARIANTS:
        med = statistics.median(times[v])
        print(f"{v:28s} {med:15.2f} {min(times[v]):6.2f}-{max(times[v]):<7.2f} {eager / med:8.3f}x "
              f"{(mm_ms + attn_ms) / med:11.0%}")
    print(f"1.3x eager would be {eager / 1.3:.2f} ms/step: {eager / 1.3 - mm_ms - attn_ms:.2f} ms left "
          f"beyond the floor for everything else (now {eager - mm_ms - attn_ms:.2f} ms eager)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
