"""Corpora: turn a data config into a list of documents, a subset and a train/val split.

Sources: ``stdlib`` (the interpreter's standard library ``*.py`` files: on every machine, no
download, the default), ``text`` (files, split at literal eos tokens) and ``jsonl`` (one
object per line, the document in ``text_field``). Each document has a stable identifier, and
the ``max_corpus_mb`` subset and the validation split are decided by SHA-1 of it (never
Python's salted ``hash()``), so they are identical everywhere. They use different salts, or a
small subset would hold validation documents only.
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
from typing import Any

from hyperloom.data.errors import DataError, fmt_int

logger = logging.getLogger("hyperloom.data")

SOURCES = ("stdlib", "text", "jsonl")
_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


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


def resolve_files(cfg: Any) -> list[SourceFile]:
    """The sorted list of files a config reads; raises DataError for bad sources/paths."""
    source = cfg.source
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r}; allowed: {', '.join(SOURCES)}")
    if source == "stdlib":
        if cfg.paths:
            logger.warning("data.source is 'stdlib'; ignoring data.paths=%s", list(cfg.paths))
        root = stdlib_root()
        files = _walk(root, ".py", _EXCLUDED_STDLIB_DIRS)
        if not files:
            raise DataError(f"no *.py files found in the standard library at {root}")
        return files

    return files_under(cfg.paths, ".txt" if source == "text" else ".jsonl", source)


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


def _read_text(f: SourceFile) -> str:
    return f.path.read_text(encoding="utf-8", errors="replace")


def _text_documents(f: SourceFile, eos_token: str) -> list[Document]:
    parts = _read_text(f).split(eos_token) if eos_token else [_read_text(f)]
    return [Document(f"{f.name}#{k}", part) for k, part in enumerate(parts) if part.strip()]


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


def _jsonl_documents(f: SourceFile, text_field: str) -> list[Document]:
    docs = []
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
            docs.append(Document(f"{f.name}#{line_no}", text))
    return docs


def load_documents(cfg: Any, files: Sequence[SourceFile] | None = None) -> list[Document]:
    """Read every document of the configured corpus, in file order."""
    files = resolve_files(cfg) if files is None else files
    docs: list[Document] = []
    for f in files:
        try:
            if cfg.source == "stdlib":
                text = _read_text(f)
                if text.strip():
                    docs.append(Document(f.name, text))
            elif cfg.source == "text":
                docs.extend(_text_documents(f, cfg.eos_token))
            else:
                docs.extend(_jsonl_documents(f, cfg.text_field))
        except OSError as exc:  # unreadable: permissions, a directory, an I/O error
            raise DataError(
                f"cannot read data file {str(f.path)!r}: {exc.strerror or exc}"
            ) from None
    if not docs:
        names = ", ".join(repr(str(f.path)) for f in files[:3]) + (
            ", ..." if len(files) > 3 else ""
        )
        raise DataError(f"the {cfg.source!r} corpus is empty: no text found in {names}")
    return docs


def select_subset(docs: Sequence[Document], max_mb: float, salt: str = "subset") -> list[Document]:
    """A deterministic subset of about `max_mb` MB (0 = all), keeping the original order.

    Documents are taken in order of a stable hash rather than alphabetically, so a 1 MB
    subset of the stdlib samples the whole library instead of only `__future__` to `ast`.
    The document that crosses the budget is included: the subset is never empty.
    """
    if max_mb < 0:
        raise DataError(f"max_corpus_mb must be >= 0 (0 = whole corpus), got {max_mb}")
    if max_mb == 0:
        return list(docs)
    budget = int(max_mb * 1e6)
    order = sorted(range(len(docs)), key=lambda i: stable_unit(docs[i].id, salt))
    chosen, total = set(), 0
    for i in order:
        if total >= budget:
            break
        chosen.add(i)
        total += docs[i].nbytes
    return [d for i, d in enumerate(docs) if i in chosen]


def split_documents(
    docs: Sequence[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, val) by a stable hash of their identifier.

    A document goes to validation when its hash falls below `val_fraction`, so adding files
    to a corpus never moves an existing document across the split. With two or more
    documents both sides are guaranteed non-empty: the lowest-hash document is moved to val,
    or the highest-hash one to train, when the fraction alone leaves a side empty.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if len(docs) < 2:
        raise DataError(
            f"the corpus has {len(docs)} document(s); at least 2 are needed to hold one out for "
            "validation (use several files, JSONL lines, or separate documents in a text file "
            "with the eos token)"
        )
    units = [stable_unit(d.id, "val") for d in docs]
    is_val = [u < val_fraction for u in units]
    if not any(is_val):
        is_val[min(range(len(docs)), key=units.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(docs)), key=units.__getitem__)] = False
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    val = [d for d, v in zip(docs, is_val, strict=True) if v]
    logger.info(
        "split %s documents: %s train, %s val (val_fraction %.3f)",
        fmt_int(len(docs)),
        fmt_int(len(train)),
        fmt_int(len(val)),
        val_fraction,
    )
    return train, val
