"""TokenDataset: a packed stream of token ids, cut into fixed-length training windows.

Documents are concatenated, each followed by eos (GPT-2/nanoGPT packing: no padding). Window
i is ``tokens[i*L : i*L + L + 1]``, inputs its first L tokens and labels its last L, so every
token but the first is a label exactly once per epoch. The array is usually a read-only memory
map of the cached ``.npy``, shared by forked workers through the page cache.

A blend (`blend.Segment`s) holds each source as one segment of the stream, and its windows
are cut within each segment; sequence indices run over the segments in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hyperloom.data.blend import Segment
from hyperloom.data.errors import DataError


class TokenDataset:
    """A 1-D array of token ids (documents joined, each followed by eos)."""

    def __init__(
        self, tokens: np.ndarray, name: str = "tokens", segments: Sequence[Segment] | None = None
    ) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"TokenDataset expects a 1-D array, got shape {tokens.shape}")
        self.tokens = tokens
        self.name = name
        self.segments = list(segments) if segments else None  # a blend's sources

    @classmethod
    def load(
        cls, path: str | Path, name: str | None = None, segments: Sequence[Segment] | None = None
    ) -> TokenDataset:
        """Memory-map a packed ``.npy`` token file."""
        path = Path(path)
        return cls(np.load(path, mmap_mode="r"), name or path.stem, segments)

    def __len__(self) -> int:
        """Number of tokens."""
        return int(self.tokens.shape[0])

    def num_sequences(self, seq_len: int) -> int:
        """Non-overlapping windows of seq_len+1 tokens with stride seq_len."""
        _check_seq_len(seq_len)
        if self.segments:
            return sum(s.windows(seq_len) for s in self.segments)
        # Window i needs tokens up to index i*seq_len + seq_len, so i <= (n - 1 - seq_len) / L.
        return max(0, (len(self) - 1) // seq_len)

    def starts(self, seq_len: int, indices: np.ndarray | None = None) -> np.ndarray:
        """Start offset of windows `indices` (default all): the arithmetic the loader relies
        on, in one place."""
        idx = np.arange(self.num_sequences(seq_len), dtype=np.int64) if indices is None else indices
        if not self.segments:
            return idx * seq_len
        counts = np.array([s.windows(seq_len) for s in self.segments], dtype=np.int64)
        first = np.cumsum(counts) - counts  # each segment's first sequence index
        seg = np.searchsorted(first, idx, side="right") - 1
        seg_starts = np.array([s.start for s in self.segments], dtype=np.int64)
        return seg_starts[seg] + (idx - first[seg]) * seq_len

    def windows(self, indices: np.ndarray | list[int], seq_len: int) -> torch.Tensor:
        """Windows for several sequence indices at once, as (len(indices), seq_len+1) int64."""
        idx = np.asarray(indices, dtype=np.int64)
        n = self.num_sequences(seq_len)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"sequence index out of range for {n} sequences of {seq_len}")
        offsets = (
            self.starts(seq_len, idx)[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
        )
        # Fancy indexing copies out of the memory map; astype gives torch a dtype it accepts.
        block = self.tokens[offsets].astype(np.int64)  # (batch, seq_len + 1)
        return torch.from_numpy(block)

    def sequence(self, i: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of sequence i, each int64 of shape (seq_len,)."""
        window = self.windows([i], seq_len)[0]  # (seq_len + 1,)
        return window[:-1].clone(), window[1:].clone()

    def __repr__(self) -> str:
        return f"TokenDataset({self.name!r}, tokens={len(self):,}, dtype={self.tokens.dtype})"


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
