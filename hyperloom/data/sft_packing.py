"""Packed SFT rows: conversations placed whole into rows of seq_len + 1 tokens, answer-only labels.

Row r's inputs are its first seq_len tokens and its labels the last seq_len, as a
`TokenDataset` window, so a sample of up to seq_len + 1 tokens fits one row whole and its
answers always see their own prompt; the rest of a row is padding (eos). As in pretraining,
the samples sharing a row are not masked from one another. `labels[i]` is the token at i + 1
where that token is an answer token and `IGNORE_INDEX` (-100, what the loss skips) elsewhere,
as the vision-language family's labels are; the model's loss is then the mean over the
labelled tokens (`engine.ops.cross_entropy`).

Packing is best-fit decreasing (each sample, longest first, into the row with the least room
that holds it: at most 11/9 of the fewest rows plus a few, Johnson 1973), deterministic, and rows follow
the file order of their first sample, so the fixed validation batches are not the longest
samples. A sample longer than a row is cut to it (counted and logged; dropped when no answer
token survives the cut) or, with `data.sft_overflow = "error"`, refused. A split is packed
for a seq_len when first asked, from the seq_len-free token arrays `sft.build_sft_data`
caches, so a new seq_len needs no rebuild.

`SFTLoader` is `ResumableLoader` (the same seeded order over rows, state dict and refusals),
so a resumed run continues bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hyperloom.data.errors import DataError, fmt_int
from hyperloom.data.loader import ResumableLoader
from hyperloom.data.multimodal.dataset import IGNORE_INDEX

logger = logging.getLogger("hyperloom.data")

OVERFLOW = ("truncate", "error")  # data.sft_overflow


def pack_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of item indices, each row's lengths summing to at most `capacity`: best-fit
    decreasing (every item, longest first, into the row with the least room that holds it).
    Rows with r free slots are found through a bitset of the r that occur, so an item costs
    a few big-integer operations, not a scan of the rows."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[list[int]] = [[] for _ in range(capacity + 1)]  # room -> rows with that room
    have = 0  # bit r set: some row has room r
    for i in order:
        n = int(lengths[i])
        if not 1 <= n <= capacity:
            raise ValueError(f"item {i} has length {n}, outside 1..{capacity}")
        above = have >> n
        if above:
            room = n + (above & -above).bit_length() - 1
            row = free[room].pop()
            if not free[room]:
                have &= ~(1 << room)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room > n:
            free[room - n].append(row)
            have |= 1 << (room - n)
    for row in rows:
        row.sort()
    return sorted(rows, key=lambda row: row[0])


@dataclass
class Packing:
    """A split packed for one seq_len: row r holds samples members[starts[r]:starts[r + 1]],
    each cut to used[i] tokens."""

    members: np.ndarray  # (samples kept,) int64
    starts: np.ndarray  # (rows + 1,) int64
    used: np.ndarray  # (samples,) int64
    truncated: int  # samples cut to a row
    dropped: int  # of those, the ones left without a label
    labels: int  # labelled (answer) tokens per epoch

    @property
    def rows(self) -> int:
        return len(self.starts) - 1

    @property
    def tokens(self) -> int:
        """Sample tokens per epoch (the rest of the rows is padding)."""
        return int(self.used[self.members].sum())


class SFTDataset:
    """One split's samples, packed into rows of seq_len + 1 tokens on demand."""

    def __init__(
        self,
        name: str,
        tokens: np.ndarray,
        mask: np.ndarray,
        lengths: np.ndarray,
        *,
        pad_id: int,
        overflow: str = "truncate",
        where: Any = None,
    ) -> None:
        if overflow not in OVERFLOW:
            raise DataError(f"data.sft_overflow must be one of {OVERFLOW}, got {overflow!r}")
        self.name = name
        self.tokens, self.mask = tokens, mask
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])  # (samples + 1,)
        self.pad_id = pad_id
        self.overflow = overflow
        self._where = where  # sample index -> "JSONL line N of file F", for messages
        self._packs: dict[int, Packing] = {}

    def __len__(self) -> int:
        """Number of samples."""
        return len(self.lengths)

    def where(self, i: int) -> str:
        return self._where(i) if self._where is not None else f"{self.name} sample {i}"

    def packing(self, seq_len: int) -> Packing:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if seq_len not in self._packs:
            self._packs[seq_len] = self._pack(seq_len + 1)
        return self._packs[seq_len]

    def _pack(self, cap: int) -> Packing:
        over = np.flatnonzero(self.lengths > cap)
        if over.size and self.overflow == "error":
            i = int(over[0])
            raise DataError(
                f"{self.where(i)}: the sample takes {fmt_int(int(self.lengths[i]))} tokens but a "
                f"row holds seq_len + 1 = {fmt_int(cap)}; {fmt_int(over.size)} of "
                f"{fmt_int(len(self))} {self.name} samples are longer, the longest takes "
                f"{fmt_int(int(self.lengths.max()))}. Raise data.seq_len, or set "
                "data.sft_overflow = 'truncate' to cut them."
            )
        used = np.minimum(self.lengths, cap)
        firsts = self.offsets[:-1]
        # Labels of each sample: its answer tokens but the first token (never a label).
        learnt = np.add.reduceat(self.mask, firsts, dtype=np.int64) - self.mask[firsts]
        for i in over:
            learnt[i] = int(self.mask[firsts[i] + 1 : firsts[i] + cap].sum())
        kept = np.flatnonzero(learnt > 0)  # a cut sample whose answers all fell off is dropped
        if kept.size == 0:
            raise DataError(
                f"every {self.name} sample loses all its answer tokens when cut to seq_len + 1 "
                f"= {fmt_int(cap)} tokens; raise data.seq_len"
            )
        rows = pack_best_fit(used[kept].tolist(), cap)
        members = kept[np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])]
        starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        pack = Packing(
            members,
            starts,
            used,
            truncated=int(over.size),
            dropped=int(len(self) - kept.size),
            labels=int(learnt[kept].sum()),
        )
        if over.size:
            logger.warning(
                "%s: %s of %s samples are longer than seq_len + 1 = %s tokens (the longest %s) "
                "and were truncated; %s of them lost every answer token and were dropped",
                self.name,
                fmt_int(pack.truncated),
                fmt_int(len(self)),
                fmt_int(cap),
                fmt_int(int(self.lengths.max())),
                fmt_int(pack.dropped),
            )
        return pack

    def num_sequences(self, seq_len: int) -> int:
        """Rows per epoch: `ResumableLoader`'s view of a dataset."""
        return self.packing(seq_len).rows

    def rows(
        self, indices: Sequence[int] | np.ndarray, seq_len: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows as (tokens, answer) arrays, each (len(indices), seq_len + 1)."""
        p = self.packing(seq_len)
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= p.rows):
            raise IndexError(f"row index out of range for {p.rows} rows of {self.name!r}")
        tokens = np.full((len(idx), seq_len + 1), self.pad_id, dtype=np.int64)
        answer = np.zeros((len(idx), seq_len + 1), dtype=bool)
        for b, r in enumerate(idx):
            pos = 0
            for i in p.members[p.starts[r] : p.starts[r + 1]]:
                n, s = int(p.used[i]), int(self.offsets[i])
                tokens[b, pos : pos + n] = self.tokens[s : s + n]
                answer[b, pos : pos + n] = self.mask[s : s + n]
                pos += n
        return tokens, answer

    def batch(
        self, indices: Sequence[int] | np.ndarray, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (len(indices), seq_len) int64; labels are IGNORE_INDEX but
        where the next token is an answer token."""
        tokens, answer = self.rows(indices, seq_len)  # (batch, seq_len + 1) each
        labels = np.where(answer[:, 1:], tokens[:, 1:], IGNORE_INDEX)
        return torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])), torch.from_numpy(labels)

    def __repr__(self) -> str:
        return f"SFTDataset({self.name!r}, samples={len(self):,}, tokens={len(self.tokens):,})"


class SFTLoader(ResumableLoader):
    """`ResumableLoader` over packed rows (same seeded order, state and checks); its batches
    are `SFTDataset.batch`'s (inputs, answer-only labels)."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.batch(self._next_indices(), self.seq_len)  # type: ignore[attr-defined]


def sft_val_batches(
    dataset: SFTDataset, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `n_batches` full batches of rows in order (fewer if the split is small): the
    same batches at every evaluation, their losses over answer tokens as in training."""
    if batch_size < 1 or n_batches < 1:
        raise DataError(f"batch_size and n_batches must be >= 1, got {batch_size}, {n_batches}")
    rows = dataset.num_sequences(seq_len)
    if rows < batch_size:
        raise DataError(
            f"the {dataset.name} split packs into {fmt_int(rows)} rows of seq_len + 1 = "
            f"{fmt_int(seq_len + 1)} tokens; one batch needs batch_size = {batch_size}. Raise "
            "data.val_fraction, or lower data.seq_len or the batch size."
        )
    if rows // batch_size < n_batches:
        logger.warning(
            "%s split fills only %d of the %d requested batches",
            dataset.name,
            rows // batch_size,
            n_batches,
        )
    return [
        dataset.batch(np.arange(b * batch_size, (b + 1) * batch_size), seq_len)
        for b in range(min(n_batches, rows // batch_size))
    ]
