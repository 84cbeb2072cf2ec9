"""Generate text from a trained run: `python sample.py --run-dir runs/<name> --prompt "ROMEO:"`.

Reads `<run_dir>/model.pt` (plain tensors + configs + tokenizer, loaded with weights_only=True),
or another such file with `--model FILE` (e.g. export.py's `model_step_<N>.pt`), or with `--snapshot` the newest valid snapshot of the run (any strategy, any world size: DCP
reassembles the shards in this one process). Needs no process group and no GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from char_dataset import tokenizer_from_dict
from config import UsageError
from export import consolidate
from model import GPT, GPTConfig


def model_from_state(state_dict: dict, gpt_cfg: GPTConfig) -> GPT:
    model = GPT(gpt_cfg)
    model.load_state_dict(state_dict)
    return model.eval()


def load_model_pt(path: Path):
    """(model, tokenizer, payload) from a model.pt written by main.py or export.py (its payload:
    snapshot.SnapshotMeta.model_file)."""
    if not path.is_file():
        raise UsageError(f"{path} not found; train first (python main.py) or export a snapshot "
                         f"(python export.py --run-dir ...)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"{path} is not a readable model.pt ({type(e).__name__}); export it again "
                         f"with python export.py") from None
    if not isinstance(payload, dict) or "model" not in payload or "model_config" not in payload:
        raise UsageError(f"{path} is not a model.pt of this project; export it again with python export.py")
    model = model_from_state(payload["model"], GPTConfig(**payload["model_config"]))
    return model, tokenizer_from_dict(payload["tokenizer"]), payload


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default=None, help="the run folder (trainer.run_dir): samples its model.pt")
    ap.add_argument("--model", default=None, help="a model.pt file to sample from instead, e.g. "
                    "<run-dir>/model_step_<N>.pt written by export.py --step N")
    ap.add_argument("--prompt", default=None, help='text to continue (default: "\\n", or the '
                    'first token of the vocabulary when it has no newline)')
    ap.add_argument("--tokens", type=int, default=300, help="tokens to generate (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=200, help="sample among the k likeliest tokens (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1337, help="sampling seed (default: %(default)s)")
    ap.add_argument("--snapshot", action="store_true", help="sample from the newest snapshot, not model.pt")
    args = ap.parse_args(argv)
    try:
        if args.tokens < 1:
            raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
        if args.prompt is not None:
            try:  # argv bytes that are not UTF-8 arrive as lone surrogates (PEP 383)
                args.prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                byte = ord(args.prompt[e.start]) & 0xFF
                raise UsageError(f"--prompt is not UTF-8 text (byte 0x{byte:02x} at character {e.start + 1}); "
                                 f"pass UTF-8 text, e.g. convert it with iconv -t utf-8") from None
        if (args.run_dir is None) == (args.model is None):
            raise UsageError("give one of --run-dir DIR (its model.pt, or --snapshot) and --model FILE")
        if args.snapshot and args.run_dir is None:
            raise UsageError("--snapshot samples a run's newest snapshot: give --run-dir DIR instead of --model")
        run_dir = Path(args.run_dir) if args.run_dir else None
        if args.model:
            model, tok, _ = load_model_pt(Path(args.model))
        elif args.snapshot:
            payload = consolidate(run_dir, None)
            model = model_from_state(payload["model"], GPTConfig(**payload["model_config"]))
            tok = tokenizer_from_dict(payload["tokenizer"])
        else:
            model, tok, _ = load_model_pt(run_dir / "model.pt")
        prompt = default_prompt(tok) if args.prompt is None else args.prompt
        print(generate_text(model, tok, prompt, args.tokens, args.temperature, args.top_k, args.seed))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
