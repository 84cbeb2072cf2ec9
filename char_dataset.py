"""The batches every rank trains on: the contiguous train/val split of a text's tokens and the
order of training windows (over tokens in memory, or over token files on disk:
corpus/token_files.py). Where the text comes from is corpus/text.py's business, how it becomes
tokens corpus/tokenizers.py's.

The order of training windows is a pure function of (seed, step): step s of epoch e reads windows
perm_e[k*B:(k+1)*B] of a per-epoch permutation, shifted by a per-epoch offset, where B is the
GLOBAL batch. A data-parallel rank takes rows [r*B/dp, (r+1)*B/dp) of that batch, so the global
batch of a step is identical whatever the world size, and a resume needs nothing but the step.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from config import UsageError

# ----------------------------------------------------------------------------- batches


@dataclass
class Batching:
    global_batch: int  # sequences per optimizer step, all dp ranks together
    dp_rank: int = 0
    dp_size: int = 1


class TokenDataset:
    """Batches over a train and a val split of token ids: 1-D int64 tensors (CharDataset), or
    token_files.TokenFiles, which read windows from files on disk through numpy.memmap. Both are
    indexed the same way (`split[int tensor]`), so the batch order below is the same code for both."""

    def __init__(self, train, val, block_size: int, seed: int, digest: str | None = None):
        self.block_size = block_size
        self.seed = seed
        self.train, self.val = train, val
        need = block_size + 1
        if train.numel() < 2 * need or val.numel() < need:
            raise UsageError(f"corpus has {train.numel()} train and {val.numel()} val tokens: too short for "
                             f"model.block_size={block_size} (train needs >= {2 * need}, val >= {need}); use a "
                             f"longer corpus, a smaller block_size or a larger validation split")
        # Non-overlapping windows with room for a shift in [0, T) and the +1 target.
        self.n_windows = (train.numel() - 1 - (block_size - 1)) // block_size
        self._perm_cache: tuple[int, torch.Tensor, int] | None = None
        self._arange = torch.arange(block_size + 1)
        self._digest = digest

    @property
    def digest(self) -> str:
        """The corpus identity a resume compares: given (a token corpus's recorded hash), or the sha256
        of the whole token stream (train + val), so a resume can tell whether the text under
        data.path changed (its path may change freely)."""
        if self._digest is None:
            h = hashlib.sha256()
            for part in (self.train, self.val):
                h.update(part.to(torch.int64).numpy().tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def steps_per_epoch(self, global_batch: int) -> int:
        return self.n_windows // global_batch

    def check_batch(self, global_batch: int) -> None:
        if self.steps_per_epoch(global_batch) < 1:
            raise UsageError(f"the train split holds {self.n_windows} windows of block_size "
                             f"{self.block_size}, fewer than trainer.batch_size={global_batch}; use a "
                             f"longer corpus or a smaller batch")

    def _epoch(self, epoch: int) -> tuple[torch.Tensor, int]:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            # int32 where it fits: the same permutation (randperm draws the same) in half the memory,
            # the one per-epoch cost that grows with the corpus (4 bytes per window)
            dtype = torch.int32 if self.n_windows < 2**31 else torch.int64
            perm = torch.randperm(self.n_windows, generator=g, dtype=dtype)
            shift = int(torch.randint(0, self.block_size, (1,), generator=g))
            self._perm_cache = (epoch, perm, shift)
        return self._perm_cache[1], self._perm_cache[2]

    def train_starts(self, step: int, global_batch: int) -> torch.Tensor:
        """Start offsets of the global batch of `step` (length global_batch)."""
        spe = self.steps_per_epoch(global_batch)
        epoch, k = divmod(step, spe)
        perm, shift = self._epoch(epoch)
        return shift + perm[k * global_batch:(k + 1) * global_batch].long() * self.block_size

    def _windows(self, data, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = data[starts[:, None] + self._arange]  # (B, T+1) in one gather
        return w[:, :-1], w[:, 1:]

    def train_batch(self, step: int, b: Batching) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's share of the global batch of `step`: (B/dp, T) inputs and targets."""
        starts = self.train_starts(step, b.global_batch)
        per = b.global_batch // b.dp_size
        return self._windows(self.train, starts[b.dp_rank * per:(b.dp_rank + 1) * per])

    def val_batches(self, n_batches: int, b: Batching):
        """Fixed validation batches (same every eval, every rank, every restart): windows evenly
        spaced over the val split; each dp rank evaluates its share of each batch."""
        total = n_batches * b.global_batch
        last = self.val.numel() - self.block_size - 1
        starts = torch.linspace(0, last, total).long()
        per = b.global_batch // b.dp_size
        for i in range(n_batches):
            s = starts[i * b.global_batch:(i + 1) * b.global_batch]
            yield self._windows(self.val, s[b.dp_rank * per:(b.dp_rank + 1) * per])


class CharDataset(TokenDataset):
    """A token stream in memory (an encoded text), split contiguously: train = first
    (1 - val_fraction), val = the rest. No window crosses the split, so no validation token is ever
    trained on."""

    def __init__(self, tokens: torch.Tensor, block_size: int, val_fraction: float, seed: int):
        n_val = int(tokens.numel() * val_fraction)
        n = tokens.numel()
        super().__init__(tokens[: n - n_val].contiguous(), tokens[n - n_val:].contiguous(), block_size, seed)
