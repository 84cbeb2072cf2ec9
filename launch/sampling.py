"""Text from a model: the sample a finished run writes (sample.txt) and what sample.py prints."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from config import UsageError
from model import GPT
from storage.files import atomic_write_text

SAMPLE_FILE = "sample.txt"
# Generation runs one token at a time at batch 1: small matmuls whose OpenMP barriers stall when a
# thread shares a core with another process. benchmarks/sample_threads.py on the 2-core machine:
# 0.8M-85M parameters, 2 threads were at most 6% faster alone and 3-13x slower beside one busy core
# (docs/performance.md#sampling-threads). Above this size, unmeasured, torch's default stays.
ONE_THREAD_UP_TO = 100_000_000  # parameters


def sampling_threads(num_params: int) -> int | None:
    """The thread count sample.py generates with: 1 up to ONE_THREAD_UP_TO parameters, else None
    (torch's default); None too when the user set OMP_NUM_THREADS, which then wins."""
    if "OMP_NUM_THREADS" in os.environ or num_params > ONE_THREAD_UP_TO:
        return None
    return 1


def default_prompt(tok) -> str:
    """Where a sample starts when no prompt is given: a line start ("\n") when the vocabulary
    has one, else its first token (a corpus without newlines has no "\n" token)."""
    try:
        if tok.encode("\n").numel() == 1:
            return "\n"
    except UsageError:
        pass
    return tok.decode([0])


def generate_text(model: GPT, tok, prompt: str, tokens: int, temperature: float = 0.8,
                  top_k: int | None = 200, seed: int = 1337) -> str:
    ids = tok.encode(prompt)
    if ids.numel() == 0:
        raise UsageError("the prompt is empty after tokenization; give --prompt some text")
    g = torch.Generator().manual_seed(seed)
    out = model.generate(ids[None, :], tokens, temperature=temperature, top_k=top_k, generator=g)
    return tok.decode(out[0].tolist())


def write_sample(model: GPT, tok, tokens: int, seed: int, run_dir: Path) -> None:
    """The end-of-run sample, from the default prompt, into <run_dir>/sample.txt and stdout."""
    (run_dir / SAMPLE_FILE).unlink(missing_ok=True)  # an older launch's sample is not this run's
    sample = generate_text(model.eval(), tok, prompt=default_prompt(tok), tokens=tokens, seed=seed)
    atomic_write_text(run_dir / SAMPLE_FILE, sample)  # whole or not at all (a full disk)
    print(f"--- sample ---\n{sample}\n--------------", flush=True)
