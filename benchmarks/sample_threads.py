"""How many threads sample.py should generate with, by model size: tokens/s of GPT.generate (the
loop sample.py runs, one token at a time, batch 1) at 1 thread and at every core, alone and beside
a process that keeps one core busy (a training run next to the sampling, the common case).

    python benchmarks/sample_threads.py            # three model sizes, char vocabulary
    python benchmarks/sample_threads.py --tokens 60

Prints the CPU model, its flags that matter for matmuls (avx2, avx512*, amx*), the core count,
then one line per (model, threads, neighbour): tokens/s. launch/sampling.py's SAMPLING_THREADS_ABOVE
is the parameter count above which more threads paid off here (docs/performance.md has the figures).
Starts one busy process: run it alone (it holds testing/local.py's machine-wide lock).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import _repo  # noqa: F401  (the repository on sys.path)
import torch

from model import GPT, GPTConfig
from testing.local import child_env, multiprocess_lock

# (layers, heads, width, block): the default model (0.8M parameters), a 10M one, GPT-2 small's body
SHAPES = [(4, 4, 128, 128), (6, 6, 384, 256), (12, 12, 768, 256)]
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n"


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return " ".join(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return "unknown"


def tokens_per_s(model: GPT, threads: int, tokens: int) -> float:
    torch.set_num_threads(threads)
    idx = torch.zeros(1, 1, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.generate(idx, 3, top_k=200, generator=g)  # warm-up
        start = time.perf_counter()
        model.generate(idx, tokens, top_k=200, generator=g)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=40, help="tokens generated per measurement")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    model_name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo", encoding="utf-8")
                       if line.startswith("model name")), "unknown")
    print(f"cpu: {model_name} | {cores} cores | flags: {cpu_flags()} | torch {torch.__version__}")
    models = []
    for n_layer, n_head, n_embd, block in SHAPES:
        model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block, vocab_size=65,
                              dropout=0.0)).eval()
        models.append((f"{n_layer}x{n_head}x{n_embd}", sum(p.numel() for p in model.parameters()), model))
    with multiprocess_lock():
        for neighbour in ("alone", "one core busy"):
            busy = subprocess.Popen([sys.executable, "-c", BUSY], env=child_env()) if neighbour != "alone" else None
            try:
                time.sleep(1.0 if busy else 0.0)
                for name, params, model in models:
                    for threads in sorted({1, cores}):
                        rate = tokens_per_s(model, threads, args.tokens)
                        print(f"{name:<10} {params / 1e6:6.2f}M params | {threads} thread(s) | {neighbour:<13} | "
                              f"{rate:8.1f} tokens/s", flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()


if __name__ == "__main__":
    main()
