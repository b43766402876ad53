"""Megatron-LM indexed datasets: already tokenized corpora as `.bin` / `.idx` pairs.

Megatron's `tools/preprocess_data.py` writes, per output prefix, the token ids of every
document back to back in `PREFIX.bin` and an index in `PREFIX.idx`
(`megatron/core/datasets/indexed_dataset.py`, `_IndexWriter`), little-endian:

    magic "MMIDIDX\\x00\\x00" (9 bytes) | version u64 = 1 | dtype code u8
    | sequence count S u64 | document count D u64
    | sequence lengths int32[S] | sequence byte offsets int64[S]
    | document indices int64[D] | (multimodal only) sequence modes int8[S]

The dtype codes are 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
8 uint16 (token files use uint16 below a 65,500-token vocabulary, else int32). A document is
the run of sequences `document_indices[k] .. document_indices[k + 1]` (the array starts at 0
and ends at S, so there are D - 1 documents); sequences are contiguous in the .bin, so a
document's tokens are one slice. Everything is checked before a token is read: the magic, the
version, an integer dtype, the .idx size against S and D, the offsets against the lengths, and
the .bin size against the last offset. Token ids are checked against the tokenizer's
vocabulary as they are copied. Both files are memory-mapped, so only the pages read are
resident.

The ids are the tokenizer's own, so `data.tokenizer` must be the tokenizer.json the files were
made with. Every document is followed by eos in the packed stream, as text documents are,
unless it already ends with it (`preprocess_data.py --append-eod`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyperloom.data.corpus import SourceFile, files_under
from hyperloom.data.errors import DataError, fmt_int

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents (34 B)
DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
_CHECK_BLOCK = 1 << 20  # index entries checked at a time


def megatron_files(paths: Sequence[str]) -> list[SourceFile]:
    """The `.idx` files `data.paths` names: a prefix (`corpus_text_document`), its .idx or
    .bin, or a directory of them; each must have its .bin beside it."""
    named = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists() and Path(f"{path}.idx").is_file():
            path = Path(f"{path}.idx")  # a prefix, as Megatron's --data-path takes it
        elif path.suffix == ".bin" and path.is_file():
            path = path.with_suffix(".idx")
        named.append(str(path))
    files = files_under(named, ".idx", "megatron")
    for f in files:
        if not f.path.with_suffix(".bin").is_file():
            raise DataError(f"megatron index {str(f.path)!r} has no data file beside it (.bin)")
    return files


@dataclass
class MegatronIndex:
    """One checked `.idx` with its `.bin`: per document, where its tokens are."""

    path: Path
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 (S,), memory-mapped
    sequence_pointers: np.ndarray  # int64 (S,) byte offsets into the .bin
    document_indices: np.ndarray  # int64 (D,)
    bin_size: int

    @classmethod
    def read(cls, idx_path: Path) -> MegatronIndex:
        where = f"megatron index {str(idx_path)!r}"
        try:
            size = idx_path.stat().st_size
            with open(idx_path, "rb") as fh:
                head = fh.read(_HEADER.size)
            bin_size = idx_path.with_suffix(".bin").stat().st_size
        except OSError as exc:
            raise DataError(f"cannot read {where}: {exc.strerror or exc}") from None
        if len(head) < _HEADER.size or head[:9] != MAGIC:
            raise DataError(f"{where} is not a Megatron index: it does not start with {MAGIC!r}")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != 1:
            raise DataError(f"{where} has index version {version}; only version 1 is known")
        if code not in DTYPES or np.dtype(DTYPES[code]).kind not in "iu":
            kind = np.dtype(DTYPES[code]).name if code in DTYPES else "unknown"
            raise DataError(f"{where} has dtype code {code} ({kind}); token ids need an integer")
        body = 12 * n_seq + 8 * n_doc  # lengths, pointers, document indices
        if size not in (_HEADER.size + body, _HEADER.size + body + n_seq):  # + modes
            raise DataError(
                f"{where} is {fmt_int(size)} bytes, but its header promises {fmt_int(n_seq)} "
                f"sequences and {fmt_int(n_doc)} document indices: {fmt_int(_HEADER.size + body)} "
                "bytes (plus one per sequence if multimodal). Is it truncated?"
            )
        if n_doc < 1:
            raise DataError(f"{where} has no document indices (it must hold at least [0])")
        mm = np.memmap(idx_path, mode="r")
        lengths = mm[_HEADER.size : _HEADER.size + 4 * n_seq].view("<i4")
        pointers = mm[_HEADER.size + 4 * n_seq : _HEADER.size + 12 * n_seq].view("<i8")
        docs = mm[_HEADER.size + 12 * n_seq : _HEADER.size + body].view("<i8")
        index = cls(idx_path, np.dtype(DTYPES[code]), lengths, pointers, docs, bin_size)
        index._check(where)
        return index

    def _check(self, where: str) -> None:
        """Document indices 0 .. S, non-decreasing; offsets the running sum of the lengths;
        the .bin exactly as long as they say. Checked a block at a time."""
        n_seq, docs, itemsize = len(self.sequence_lengths), self.document_indices, self.itemsize
        if docs[0] != 0 or docs[-1] != n_seq:
            raise DataError(
                f"{where}: document indices run from {docs[0]} to {docs[-1]}; they must run "
                f"from 0 to the sequence count {fmt_int(n_seq)}"
            )
        expected = 0  # byte offset of the next sequence
        for lo in range(0, max(len(docs), n_seq), _CHECK_BLOCK):
            d = np.asarray(docs[lo : lo + _CHECK_BLOCK + 1])
            if (np.diff(d) < 0).any():
                raise DataError(f"{where}: document indices decrease near document {lo}")
            lengths = np.asarray(self.sequence_lengths[lo : lo + _CHECK_BLOCK], dtype=np.int64)
            if (lengths < 0).any():
                raise DataError(f"{where}: a negative sequence length near sequence {lo}")
            starts = expected + np.concatenate([[0], np.cumsum(lengths[:-1] * itemsize)])
            if len(lengths) and not np.array_equal(
                self.sequence_pointers[lo : lo + len(lengths)], starts
            ):
                raise DataError(
                    f"{where}: sequence byte offsets near sequence {lo} do not follow the lengths "
                    "(sequences must lie back to back in the .bin)"
                )
            expected += int(lengths.sum()) * itemsize
        if expected != self.bin_size:
            raise DataError(
                f"{where}: the sequences hold {fmt_int(expected)} bytes but the .bin has "
                f"{fmt_int(self.bin_size)}; the pair does not match (or the .bin is truncated)"
            )

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def token_bounds(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(first token, end token) of documents lo .. hi - 1, int64 each."""
        seq = np.asarray(self.document_indices[lo : hi + 1])  # first sequence of each
        n_seq = len(self.sequence_pointers)
        # A sequence's byte offset; one past the last sequence, the end of the data.
        inside = seq < n_seq
        offsets = np.full(len(seq), self.bin_size, dtype=np.int64)
        offsets[inside] = self.sequence_pointers[seq[inside]]
        bounds = offsets // self.itemsize
        return bounds[:-1], bounds[1:]

    def tokens(self) -> np.ndarray:
        """The .bin as a memory-mapped array of token ids."""
        return np.memmap(self.path.with_suffix(".bin"), dtype=self.dtype, mode="r")


def document_sizes(f: SourceFile) -> tuple[str, np.ndarray, np.ndarray]:
    """(the name in document ids, bytes of tokens, document numbers) of the non-empty
    documents of one pair; document k's id is `name#k`."""
    index = MegatronIndex.read(f.path)
    stem = f.name[: -len(".idx")] if f.name.endswith(".idx") else f.name
    counts = np.zeros(index.num_documents, dtype=np.int64)
    for lo in range(0, index.num_documents, _CHECK_BLOCK):
        hi = min(lo + _CHECK_BLOCK, index.num_documents)
        starts, ends = index.token_bounds(lo, hi)
        counts[lo:hi] = ends - starts
    kept = np.flatnonzero(counts > 0)
    return stem, counts[kept] * index.itemsize, kept


def document_tokens(
    f: SourceFile, wanted: np.ndarray, vocab_size: int, block_tokens: int = 1 << 20
) -> Iterator[list[np.ndarray]]:
    """Token ids of the documents numbered `wanted` (ascending), about `block_tokens` at a
    time, one array per document; DataError naming a document with an id outside the
    tokenizer's vocabulary."""
    index = MegatronIndex.read(f.path)
    data = index.tokens()
    block: list[np.ndarray] = []
    numbers: list[int] = []
    held = 0
    for lo in range(0, len(wanted), _CHECK_BLOCK):
        ks = np.asarray(wanted[lo : lo + _CHECK_BLOCK], dtype=np.int64)
        firsts, ends = index.token_bounds(int(ks[0]), int(ks[-1]) + 1)
        picked = ks - ks[0]
        for k, a, b in zip(ks, firsts[picked], ends[picked], strict=True):
            block.append(np.array(data[a:b]))  # a copy: the output holds no map
            numbers.append(int(k))
            held += int(b - a)
            if held >= block_tokens:
                yield _checked(block, numbers, f, vocab_size)
                block, numbers, held = [], [], 0
    if block:
        yield _checked(block, numbers, f, vocab_size)


def _checked(
    block: list[np.ndarray], numbers: list[int], f: SourceFile, vocab_size: int
) -> list[np.ndarray]:
    """`block`, once every id in it is a token of the vocabulary."""
    joined = np.concatenate(block)
    if not joined.size or (int(joined.max()) < vocab_size and int(joined.min()) >= 0):
        return block
    for k, ids in zip(numbers, block, strict=True):
        low, high = int(ids.min()), int(ids.max())
        if high >= vocab_size or low < 0:
            raise DataError(
                f"megatron dataset {str(f.path.with_suffix(''))!r}: document {k} holds token id "
                f"{high if high >= vocab_size else low}, outside the tokenizer's vocabulary of "
                f"{fmt_int(vocab_size)} ids; data.tokenizer must be the tokenizer the .bin was "
                "made with"
            )
    raise AssertionError("unreachable: the block held a bad id")
