"""Tokenize text into a token corpus for data.path: `python prepare.py INPUT... --tokenizer gpt2|char
--out DIR`, then train with `data.path=DIR data.tokenizer=gpt2|char`.

INPUT: text files (UTF-8) and folders (every file under them not hidden, in sorted path order),
read as one text in the order given. gpt2 appends <|endoftext|> (id 50256) after each file, as
nanoGPT's openwebtext prepare does; char's vocabulary is the sorted set of all characters (a first,
parallel pass collects it), so its ids are corpus/tokenizers.py CharTokenizer's for the same text.

Streaming, so a corpus larger than memory works: each file is cut into chunks of about
--chunk-bytes at line breaks where tokenizing the pieces apart gives the same tokens as the whole (a
"\\n" between two printable ASCII characters: no GPT-2 pre-token crosses it), worker processes
tokenize them, and the ids are written in input order into shards of at most --shard-tokens ids as
they arrive; at most 2 x --workers chunks are in flight.

The validation split: the last --val-fraction of the input bytes, starting at the first such line
break at or after that point (or at a file boundary). It is contiguous and no text is in both
splits, like a text corpus's split (char_dataset.CharDataset), here fixed once in the files.

DIR/corpus.json (corpus/token_files.py CorpusRecord) is written last: the tokenizer, dtype (the smallest of
uint8/uint16/uint32 that holds the vocabulary), per-shard token counts, hashes and probes, the
largest id, and the sha256 of all token bytes, which a training run uses as the corpus identity.
`python prepare.py --verify DIR` re-hashes every shard against it. Bad input: one line, exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from config import UsageError
from corpus.build import prepare, verify
from corpus.kinds import SIDECAR


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message}; see python prepare.py --help")


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("inputs", nargs="*", metavar="INPUT", help="text files or folders")
    ap.add_argument("--tokenizer", choices=("gpt2", "char"), help="gpt2 (tiktoken r50k_base) or char")
    ap.add_argument("--out", help="new (or empty) folder for the shards and corpus.json")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="last fraction of the input bytes held out "
                    "for validation (default %(default)s)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes "
                    "(default: the CPU count, %(default)s; 1: in this process)")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="ids per shard file (default %(default)s)")
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20, help="text per worker task (default %(default)s)")
    ap.add_argument("--verify", metavar="DIR", help="re-hash a prepared folder's shards against its corpus.json")
    out, fresh = None, False  # fresh: this launch may delete what is in `out` when it fails
    try:
        args = ap.parse_args(argv)
        if args.verify:
            rec = verify(Path(args.verify).expanduser())
            print(f"ok: {args.verify} matches {SIDECAR} ({sum(s.tokens for s in rec.train + rec.val):,} tokens)")
            return 0
        if not args.inputs or not args.tokenizer or not args.out:
            raise UsageError("give INPUT..., --tokenizer gpt2|char and --out DIR (or --verify DIR)")
        if not 0.0 < args.val_fraction < 1.0:
            raise UsageError(f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
        for name in ("workers", "shard_tokens", "chunk_bytes"):
            if getattr(args, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        out = Path(args.out).expanduser()
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UsageError(f"--out {out} exists and is not an empty folder; name a new folder")
        out.mkdir(parents=True, exist_ok=True)
        fresh = True
        rec = prepare(args.inputs, args.tokenizer, out, args.workers, args.val_fraction, args.chunk_bytes,
                      args.shard_tokens)
        fresh = False
        n_train, n_val = sum(s.tokens for s in rec.train), sum(s.tokens for s in rec.val)
        print(f"wrote {out}: {n_train:,} train + {n_val:,} val tokens in {len(rec.train) + len(rec.val)} "
              f"{rec.dtype} shards, vocabulary {rec.vocab_size}; train with data.path={out} "
              f"data.tokenizer={args.tokenizer}")
        return 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if fresh:  # a failed run leaves no half-written shards behind (--out was new or empty)
            for p in out.iterdir():
                p.unlink()


if __name__ == "__main__":
    sys.exit(main())
