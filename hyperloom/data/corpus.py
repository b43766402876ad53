"""Corpora: documents with stable identifiers, read as streams; the subset and the split.

Sources of text (`readers` knows them all): ``stdlib`` (the interpreter's standard library
``*.py`` files: on every machine, no download, the default), ``text`` (files, split at literal
eos tokens) and ``jsonl`` (one object per line, the document in ``text_field``) live here;
Parquet, Arrow and Megatron files in their own modules. Every reader yields documents one at a
time, so a corpus never has to fit in memory.

Each document has a stable identifier, and the ``max_corpus_mb`` subset, the validation split
and the tokenizer's training sample are decided by SHA-1 of it (never Python's salted
``hash()``), so they are identical everywhere. They use different salts, or a small subset
would hold validation documents only. The rules work on arrays of those hashes and sizes
(`budget_mask`, `split_mask`), which is what lets a build decide them in one pass over a corpus
that does not fit in memory and then read it again for the chosen documents only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyperloom.data.errors import DataError, fmt_int

logger = logging.getLogger("hyperloom.data")

_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_READ_CHARS = 1 << 20  # a text file is read this many characters at a time


@dataclass(frozen=True)
class SourceFile:
    """A file to read, and the name used for it in document identifiers."""

    path: Path  # absolute path on this machine
    name: str  # path relative to the root it was found under (machine independent)


@dataclass(frozen=True)
class Document:
    """One document: a stable identifier and its text."""

    id: str
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def stable_unit(identifier: str, salt: str) -> float:
    """Map an identifier to a number in [0, 1) that is the same on every machine and run."""
    digest = hashlib.sha1(f"{salt}:{identifier}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _walk(root: Path, suffix: str, skip_dirs: frozenset[str] = frozenset()) -> list[SourceFile]:
    """Files under `root` ending in `suffix`, recursively, sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk descending (site-packages can dwarf the stdlib),
        # and sorting makes the traversal order deterministic.
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        for fname in filenames:
            if fname.endswith(suffix) and not fname.startswith("."):
                full = Path(dirpath) / fname
                found.append(SourceFile(full, full.relative_to(root).as_posix()))
    return sorted(found, key=lambda f: f.name)


def stdlib_files() -> list[SourceFile]:
    """The standard library's *.py files (without site-packages), sorted."""
    root = stdlib_root()
    files = _walk(root, ".py", _EXCLUDED_STDLIB_DIRS)
    if not files:
        raise DataError(f"no *.py files found in the standard library at {root}")
    return files


def files_under(paths: Sequence[str], suffix: str, source: str) -> list[SourceFile]:
    """The files `data.paths` names: files as given, directories searched recursively for
    *`suffix` files, in order; DataError for an empty list, a missing path or an empty dir."""
    if not paths:
        raise DataError(f"data.source is {source!r} but data.paths is empty; list files or dirs")
    files: list[SourceFile] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise DataError(f"data path {str(raw)!r} does not exist")
        if path.is_dir():
            found = _walk(path.resolve(), suffix)
            if not found:
                raise DataError(f"directory {str(raw)!r} contains no *{suffix} files")
            files.extend(found)
        else:
            files.append(SourceFile(path.resolve(), path.name))
    return files


def file_fingerprint(files: Sequence[SourceFile]) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) per file: cheap to compute, changes whenever a file does."""
    out = []
    for f in files:
        st = f.path.stat()
        out.append((str(f.path), st.st_size, st.st_mtime_ns))
    return out


# --- text, JSONL and stdlib documents, streamed ----------------------------------------------


def stdlib_documents(f: SourceFile) -> Iterator[Document]:
    """A standard-library file is one document (source files are small)."""
    text = f.path.read_text(encoding="utf-8", errors="replace")
    if text.strip():
        yield Document(f.name, text)


def text_documents(f: SourceFile, eos_token: str) -> Iterator[Document]:
    """A text file's documents: split at each literal eos token, read a block at a time, so a
    file of any size streams (the k-th part is `name#k`; blank parts are skipped)."""
    k, buf = 0, ""
    with open(f.path, encoding="utf-8", errors="replace") as fh:
        while block := fh.read(_READ_CHARS):
            buf += block
            if not eos_token:
                continue
            *whole, buf = buf.split(eos_token)  # the tail may hold the start of an eos
            for part in whole:
                if part.strip():
                    yield Document(f"{f.name}#{k}", part)
                k += 1
    if buf.strip():
        yield Document(f"{f.name}#{k}", buf)


def jsonl_objects(path: Path) -> Iterator[tuple[int, str, dict]]:
    """(line number, "JSONL line N of file F" for messages, the object) for each non-blank
    line of a JSONL file; DataError naming the line for one that is not a JSON object."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"JSONL line {line_no} of file {str(path)!r}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where} is not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(record, dict):
                raise DataError(f"{where} is a JSON {type(record).__name__}, expected an object")
            yield line_no, where, record


def jsonl_documents(f: SourceFile, text_field: str) -> Iterator[Document]:
    """One document per JSONL line (`name#line`), its text in `text_field`."""
    for line_no, where, record in jsonl_objects(f.path):
        if text_field not in record:
            keys = ", ".join(sorted(record)) or "none"
            raise DataError(f"{where} lacks field {text_field!r} (fields present: {keys})")
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(
                f"{where}: field {text_field!r} is a {type(text).__name__}, expected a string"
            )
        if text.strip():
            yield Document(f"{f.name}#{line_no}", text)


# --- the subset and the split ----------------------------------------------------------------


def units(ids: Sequence[str], salt: str) -> np.ndarray:
    """`stable_unit` of each identifier, as float64."""
    return np.fromiter((stable_unit(i, salt) for i in ids), dtype=np.float64, count=len(ids))


def budget_mask(units: np.ndarray, nbytes: np.ndarray, budget: float) -> np.ndarray:
    """Documents taken in order of their hash until `budget` bytes are reached, the one that
    crosses it included (never empty); ties keep the original order. A boolean mask."""
    order = np.argsort(units, kind="stable")
    before = np.cumsum(nbytes[order]) - nbytes[order]  # bytes taken before each document
    mask = np.zeros(len(units), dtype=bool)
    mask[order[before < budget]] = True
    return mask


def subset_mask(units: np.ndarray, nbytes: np.ndarray, max_mb: float) -> np.ndarray:
    """The `max_corpus_mb` subset (0 = all) as a mask; see `select_subset`."""
    if max_mb < 0:
        raise DataError(f"max_corpus_mb must be >= 0 (0 = whole corpus), got {max_mb}")
    if max_mb == 0:
        return np.ones(len(units), dtype=bool)
    return budget_mask(units, nbytes, int(max_mb * 1e6))


def split_mask(units: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents are validation documents; see `split_documents`."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(units)
    if n < 2:
        raise DataError(
            f"the corpus has {n} document(s); at least 2 are needed to hold one out for "
            "validation (use several files, JSONL lines, or separate documents in a text file "
            "with the eos token)"
        )
    is_val = units < val_fraction
    if not is_val.any():
        is_val[int(np.argmin(units))] = True
    if is_val.all():
        is_val[int(np.argmax(units))] = False
    return is_val


def log_split(n_train: int, n_val: int, val_fraction: float, what: str = "") -> None:
    logger.info(
        "split %s%s documents: %s train, %s val (val_fraction %.3f)",
        what,
        fmt_int(n_train + n_val),
        fmt_int(n_train),
        fmt_int(n_val),
        val_fraction,
    )


def select_subset(docs: Sequence[Document], max_mb: float, salt: str = "subset") -> list[Document]:
    """A deterministic subset of about `max_mb` MB (0 = all), keeping the original order.

    Documents are taken in order of a stable hash rather than alphabetically, so a 1 MB
    subset of the stdlib samples the whole library instead of only `__future__` to `ast`.
    The document that crosses the budget is included: the subset is never empty.
    """
    sizes = np.array([d.nbytes for d in docs], dtype=np.int64)
    mask = subset_mask(units([d.id for d in docs], salt), sizes, max_mb)
    return [d for d, keep in zip(docs, mask, strict=True) if keep]


def split_documents(
    docs: Sequence[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, val) by a stable hash of their identifier.

    A document goes to validation when its hash falls below `val_fraction`, so adding files
    to a corpus never moves an existing document across the split. With two or more
    documents both sides are guaranteed non-empty: the lowest-hash document is moved to val,
    or the highest-hash one to train, when the fraction alone leaves a side empty.
    """
    is_val = split_mask(units([d.id for d in docs], "val"), val_fraction)
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    val = [d for d, v in zip(docs, is_val, strict=True) if v]
    log_split(len(train), len(val), val_fraction)
    return train, val
