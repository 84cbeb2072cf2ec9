"""Generate text from a trained run: `python sample.py --run-dir runs/<name> --prompt "ROMEO:"`.

Reads `<run_dir>/model.pt` (plain tensors + configs + tokenizer, loaded with weights_only=True:
weights/model_file.py), another such file with `--model FILE` (e.g. export.py's
`model_step_<N>.pt`), or with `--snapshot` the newest valid snapshot of the run (any strategy, any
world size: DCP reassembles the shards in this one process). Needs no process group and no GPU.
Generates with one thread up to 100M parameters, faster on a busy CPU (launch/sampling.py;
OMP_NUM_THREADS, when set, wins). `| head -1` ends it quietly (exit 141, as SIGPIPE would).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from config import TrainerConfig, UsageError
from corpus.text import FALLBACK_RUN_DIR
from corpus.tokenizers import tokenizer_from_dict
from launch.errors import quiet_broken_pipe
from launch.sampling import default_prompt, generate_text, sampling_threads
from weights.consolidate import consolidate
from weights.model_file import MISSING, MODEL_FILE, read_model_file


def _missing(run_dir: Path) -> str:
    """What to do when run_dir has no model.pt. An offline first run fell back to the standard
    library's text and trained into a folder of its own: name it."""
    if run_dir == Path(TrainerConfig.run_dir) and (Path(FALLBACK_RUN_DIR) / MODEL_FILE).is_file():
        return (f"the default run fell back to the standard library's text (offline) and trained into "
                f"{FALLBACK_RUN_DIR}: python sample.py --run-dir {FALLBACK_RUN_DIR}")
    return MISSING


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
            model_file = read_model_file(Path(args.model))
        elif args.snapshot:
            model_file = consolidate(run_dir, None)
        else:
            model_file = read_model_file(run_dir / MODEL_FILE, missing=_missing(run_dir))
        model, tok = model_file.build_model(), tokenizer_from_dict(model_file.tokenizer)
        threads = sampling_threads(sum(p.numel() for p in model.parameters()))
        if threads is not None:
            torch.set_num_threads(threads)
        prompt = default_prompt(tok) if args.prompt is None else args.prompt
        print(generate_text(model, tok, prompt, args.tokens, args.temperature, args.top_k, args.seed))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(quiet_broken_pipe(main))
