"""The streaming build: a corpus of any size into two token files, tokenized in parallel.

Three passes over the documents, none of which holds the corpus in memory:

1. **census** (`take_census`): per document its three hash units (subset, split, tokenizer
   sample) and its size, 32 bytes a document, and per file how many documents it holds. The
   subset, the split and the sample are decided from these arrays alone (`corpus.budget_mask`,
   `corpus.split_mask`), exactly as for a list of documents in memory.
2. **the tokenizer's sample** (`tokenizer_sample`), only when the built-in BPE is trained:
   the chosen training documents up to `TRAIN_CAP_MB`, read again.
3. **encode** (`encode_sources`): the chosen documents read again, file by file (a file holding
   none is skipped), in chunks of about `CHUNK_BYTES` that `workers` processes tokenize. The
   chunks come back in the order they were sent and are appended to the train and val token
   files on disk (`TokenWriter`), so the files are the same byte for byte for any number of
   workers (`pool`). At most 2 x workers chunks are in flight, which bounds the memory
   whatever the corpus size.
"""

from __future__ import annotations

import logging
import os
import tempfile
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hyperloom.data.corpus import (
    Document,
    SourceFile,
    budget_mask,
    log_split,
    split_mask,
    stable_unit,
    subset_mask,
)
from hyperloom.data.errors import DataError, fmt_int
from hyperloom.data.megatron import document_sizes, document_tokens
from hyperloom.data.pool import in_order
from hyperloom.data.readers import empty_corpus, file_documents, source_fingerprint
from hyperloom.data.tokenizer import Tokenizer, token_dtype

logger = logging.getLogger("hyperloom.data")

CHUNK_BYTES = 1 << 20  # text per chunk handed to a worker
CHUNK_DOCS = 1024  # ... or this many documents, whichever comes first


@dataclass
class Source:
    """One corpus to read: the whole `[data]` config, or one `[[data.blend]]` entry."""

    name: str
    kind: str  # a readers.SOURCES entry
    files: list[SourceFile]
    text_field: str = "text"
    weight: float = 1.0

    def fingerprint(self) -> list[tuple[str, int, int]]:
        return source_fingerprint(self.kind, self.files)


@dataclass
class Census:
    """Pass one over a source, and what was decided from it (`choose`)."""

    units: dict[str, np.ndarray]  # salt -> float64 (documents,)
    nbytes: np.ndarray  # int64 (documents,): UTF-8 bytes, or token bytes for megatron
    part_starts: np.ndarray  # int64 (files + 1,): each file's first document
    fingerprint: list[tuple[str, int, int]]  # the files as they were read
    numbers: list[np.ndarray] = field(default_factory=list)  # megatron: kept document numbers
    chosen: np.ndarray | None = None  # bool (documents,): in the max_corpus_mb subset
    is_val: np.ndarray | None = None  # bool (documents,): a validation document

    def choose(self, max_mb: float, val_fraction: float) -> None:
        self.chosen = subset_mask(self.units["subset"], self.nbytes, max_mb)
        self.is_val = np.zeros(len(self.nbytes), dtype=bool)
        self.is_val[self.chosen] = split_mask(self.units["val"][self.chosen], val_fraction)

    def files_with(self, mask: np.ndarray) -> Iterator[tuple[int, int, int]]:
        """(file number, first, end document) of each file holding a document of `mask`."""
        for p in range(len(self.part_starts) - 1):
            lo, hi = int(self.part_starts[p]), int(self.part_starts[p + 1])
            if mask[lo:hi].any():
                yield p, lo, hi

    def counts(self) -> dict[str, int]:
        assert self.chosen is not None and self.is_val is not None
        return {
            "documents": int(self.chosen.sum()),
            "train_documents": int((self.chosen & ~self.is_val).sum()),
            "val_documents": int(self.is_val.sum()),
            "bytes": int(self.nbytes[self.chosen].sum()),
        }


def take_census(src: Source, eos_token: str, advance: Callable[[int], None]) -> Census:
    """Pass one: every document's hash units and size; DataError for an empty corpus."""
    units = {salt: array("d") for salt in ("subset", "val", "tokenizer")}
    nbytes, starts, numbers = array("q"), [0], []
    fingerprint = src.fingerprint()
    for f in src.files:
        if src.kind == "megatron":
            stem, token_bytes, kept = document_sizes(f)
            numbers.append(kept)
            docs: Iterator[tuple[str, int]] = (
                (f"{stem}#{k}", size)
                for k, size in zip(_ints(kept), _ints(token_bytes), strict=True)
            )
        else:
            docs = (
                (d.id, d.nbytes) for d in file_documents(src.kind, f, src.text_field, eos_token)
            )
        count = 0
        for doc_id, size in docs:  # one at a time: a file may hold more than memory does
            for salt, column in units.items():
                column.append(stable_unit(doc_id, salt))
            nbytes.append(size)
            count += 1
        starts.append(starts[-1] + count)
        advance(f.path.stat().st_size)
    if not nbytes:
        raise DataError(empty_corpus(src.kind, src.files))
    return Census(
        units={salt: np.frombuffer(a, dtype=np.float64) for salt, a in units.items()},
        nbytes=np.frombuffer(nbytes, dtype=np.int64),
        part_starts=np.array(starts, dtype=np.int64),
        fingerprint=fingerprint,
        numbers=numbers,
    )


def _ints(values: np.ndarray, block: int = 1 << 16) -> Iterator[int]:
    """An integer array's values as Python ints, converted a block at a time."""
    for lo in range(0, len(values), block):
        yield from values[lo : lo + block].tolist()


def choose_all(
    sources: Sequence[Source], censuses: Sequence[Census], max_mb: float, val_fraction: float
) -> None:
    """Each source's subset and split (a blend splits every source on its own)."""
    for src, c in zip(sources, censuses, strict=True):
        try:
            c.choose(max_mb, val_fraction)
        except DataError as exc:
            raise DataError(f"{src.name}: {exc}" if len(sources) > 1 else str(exc)) from None
        n = c.counts()
        what = f"{src.name}: " if len(sources) > 1 else ""
        log_split(n["train_documents"], n["val_documents"], val_fraction, what)


def tokenizer_sample(
    sources: Sequence[Source], censuses: Sequence[Census], eos_token: str, cap_mb: float
) -> list[Document]:
    """Pass two: the training documents the built-in BPE learns from, about `cap_mb` MB of
    all text sources together, chosen by hash (`tokenizer._training_texts`' rule)."""
    trains = [
        (s, c.chosen & ~c.is_val)
        for s, (src, c) in enumerate(zip(sources, censuses, strict=True))
        if src.kind != "megatron"
    ]
    if not trains:
        raise DataError("no text to train the built-in tokenizer on; set data.tokenizer")
    keys = np.concatenate([censuses[s].units["tokenizer"][m] for s, m in trains])
    sizes = np.concatenate([censuses[s].nbytes[m] for s, m in trains])
    picked = budget_mask(keys, sizes, int(cap_mb * 1e6))
    out: list[Document] = []
    at = 0
    for s, train in trains:
        src, c = sources[s], censuses[s]
        want = np.zeros_like(train)
        want[train] = picked[at : at + int(train.sum())]
        at += int(train.sum())
        for p, lo, hi in c.files_with(want):
            docs = _documents(src, p, hi - lo, eos_token)
            out += [d for i, d in enumerate(docs, start=lo) if want[i]]
    return out


def _documents(src: Source, p: int, expected: int, eos_token: str) -> Iterator[Document]:
    """File p's documents again; DataError if it no longer holds the census's count."""
    n = 0
    for n, doc in enumerate(file_documents(src.kind, src.files[p], src.text_field, eos_token), 1):
        if n <= expected:
            yield doc
    if n != expected:
        raise _changed(str(src.files[p].path))


def _changed(path: str) -> DataError:
    return DataError(f"data file {path!r} changed while the cache was being built; run again")


# --- pass three: tokenize and append ------------------------------------------------------


def encode_sources(
    sources: Sequence[Source],
    censuses: Sequence[Census],
    tok: Tokenizer,
    writers: tuple[TokenWriter, TokenWriter],
    workers: int,
    advance: Callable[[int], None],
) -> tuple[list[dict[str, int]], int]:
    """Pass three: each source's chosen documents, tokenized, appended to the (train, val)
    writers in source order; returns each source's token counts, and the workers used."""
    stats = [{"train_tokens": 0, "val_tokens": 0} for _ in sources]
    text_bytes = sum(
        int(c.nbytes[c.chosen].sum())
        for src, c in zip(sources, censuses, strict=True)
        if src.kind != "megatron"
    )
    workers = min(workers, max(1, -(-text_bytes // CHUNK_BYTES)))  # no idle processes
    items = _chunks(sources, censuses, tok)
    for s, (train, val), nbytes in in_order(items, tok, workers):
        writers[0].append(train)
        writers[1].append(val)
        stats[s]["train_tokens"] += len(train)
        stats[s]["val_tokens"] += len(val)
        advance(nbytes)
    for src, c in zip(sources, censuses, strict=True):
        try:
            now = src.fingerprint()
        except OSError as exc:
            raise _changed(str(exc.filename)) from None
        for after, before in zip(now, c.fingerprint, strict=True):
            if after != before:
                raise _changed(after[0])
    return stats, workers


def _chunks(sources: Sequence[Source], censuses: Sequence[Census], tok: Tokenizer) -> Iterator:
    """(source, "text" or "tokens", payload, bytes) in order: texts with their split flags
    for a worker, or Megatron documents already packed."""
    dtype = token_dtype(tok.vocab_size)
    for s, (src, c) in enumerate(zip(sources, censuses, strict=True)):
        assert c.chosen is not None and c.is_val is not None
        for p, lo, hi in c.files_with(c.chosen):
            if src.kind == "megatron":
                picked = c.chosen[lo:hi]
                val_flags = c.is_val[lo:hi][picked]
                at = 0
                for block in document_tokens(src.files[p], c.numbers[p][picked], tok.vocab_size):
                    packed = _pack_tokens(block, val_flags[at : at + len(block)], tok.eos_id, dtype)
                    at += len(block)
                    yield s, "tokens", packed, sum(b.nbytes for b in block)
                continue
            texts: list[str] = []
            is_val: list[bool] = []
            held = 0
            for i, doc in enumerate(_documents(src, p, hi - lo, tok.eos_token), start=lo):
                if not c.chosen[i]:
                    continue
                texts.append(doc.text)
                is_val.append(bool(c.is_val[i]))
                held += int(c.nbytes[i])
                if held >= CHUNK_BYTES or len(texts) >= CHUNK_DOCS:
                    yield s, "text", (texts, is_val), held
                    texts, is_val, held = [], [], 0
            if texts:
                yield s, "text", (texts, is_val), held


def _pack_tokens(
    block: list[np.ndarray], is_val: np.ndarray, eos_id: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Megatron documents into (train, val) streams, eos after each (unless it ends with one)."""
    sides: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    eos = np.array([eos_id], dtype=dtype)
    for ids, v in zip(block, is_val, strict=True):
        sides[int(v)].append(ids.astype(dtype, copy=False))
        if ids[-1] != eos_id:
            sides[int(v)].append(eos)
    return tuple(np.concatenate(p) if p else np.zeros(0, dtype) for p in sides)  # type: ignore[return-value]


# --- token files ------------------------------------------------------------------------------


def cache_write_error(dest: Path, exc: OSError) -> DataError:
    return DataError(
        f"cannot write the data cache file {str(dest)!r}: {exc.strerror or exc}; free space "
        f"there or point data.cache_dir (or $HYPERLOOM_CACHE) at a writable directory"
    )


class TokenWriter:
    """A 1-D `.npy` of token ids written as a stream: its header (always 128 bytes for one
    dimension) first, for length 0, the ids appended, then the header again with the count.
    It is written under a temporary name and renamed into place by `commit`."""

    def __init__(self, dest: Path, dtype: np.dtype) -> None:
        self.dest, self.dtype, self.count = dest, np.dtype(dtype), 0
        try:
            fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
            self.tmp = Path(name)
            self.fh = os.fdopen(fd, "wb")
            self._header_size = self._write_header()
        except OSError as exc:
            raise cache_write_error(dest, exc) from None

    def _write_header(self) -> int:
        start = self.fh.tell()
        header = {"descr": self.dtype.str, "fortran_order": False, "shape": (self.count,)}
        np.lib.format.write_array_header_1_0(self.fh, header)
        return self.fh.tell() - start

    def append(self, ids: np.ndarray) -> None:
        try:
            self.fh.write(np.ascontiguousarray(ids, dtype=self.dtype).data)
        except OSError as exc:
            raise cache_write_error(self.dest, exc) from None
        self.count += len(ids)

    def commit(self) -> int:
        """Finish the header and rename the file into place; returns the token count."""
        try:
            self.fh.seek(0)
            if self._write_header() != self._header_size:  # numpy pads it to 128 bytes
                raise AssertionError("the .npy header changed size")
            self.fh.close()
            os.replace(self.tmp, self.dest)
        except OSError as exc:
            raise cache_write_error(self.dest, exc) from None
        finally:
            self.discard()
        return self.count

    def discard(self) -> None:
        self.fh.close()
        self.tmp.unlink(missing_ok=True)


def log_encoded(stats: Sequence[dict[str, int]], nbytes: int, seconds: float, workers: int) -> None:
    train = sum(s["train_tokens"] for s in stats)
    val = sum(s["val_tokens"] for s in stats)
    logger.info(
        "tokenized %.1f MB into %s tokens (train %s, val %s) in %.1f s with %d worker%s (%.2f MB/s)",
        nbytes / 1e6,
        fmt_int(train + val),
        fmt_int(train),
        fmt_int(val),
        seconds,
        workers,
        "" if workers == 1 else "s",
        nbytes / 1e6 / max(seconds, 1e-9),
    )
