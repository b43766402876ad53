"""Readers: every source's files, and their documents one at a time.

| source     | files (a directory gives these)   | a document                     | its id       |
|------------|-----------------------------------|--------------------------------|--------------|
| `stdlib`   | the standard library's `*.py`     | a file                         | `path`       |
| `text`     | `*.txt` (a named file: any name)  | a file, or each eos-split part | `name#k`     |
| `jsonl`    | `*.jsonl`                         | `text_field` of a line         | `name#line`  |
| `parquet`  | `*.parquet`                       | `text_field` of a row          | `name#row`   |
| `arrow`    | `*.arrow` (HF `datasets`)         | `text_field` of a row          | `name#row`   |
| `megatron` | `*.idx` with its `.bin`           | a document of token ids        | `prefix#k`   |

Parquet is read a record batch at a time (`ParquetFile.iter_batches`, so a row group of the
text column at most is in memory). `arrow` is the Arrow IPC format the Hugging Face `datasets`
library writes: the `data-*.arrow` files of a `save_to_disk` folder and the `*.arrow` files in
its cache; they are read as record-batch streams with buffered reads, not memory-mapped
(https://arrow.apache.org/docs/python/ipc.html). A null or blank text is skipped like a blank
JSONL line. pyarrow is an optional dependency (`pip install 'hyperloom[data]'`); `datasets`
itself is never needed. Megatron's token files are `megatron`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hyperloom.data.corpus import (
    Document,
    SourceFile,
    file_fingerprint,
    files_under,
    jsonl_documents,
    stdlib_documents,
    stdlib_files,
    text_documents,
)
from hyperloom.data.errors import DataError

logger = logging.getLogger("hyperloom.data")

SOURCES = ("stdlib", "text", "jsonl", "parquet", "arrow", "megatron")
SUFFIXES = {"text": ".txt", "jsonl": ".jsonl", "parquet": ".parquet", "arrow": ".arrow"}
BATCH_ROWS = 1024  # rows per Parquet record batch
ARROW_EXTRA = "pip install 'hyperloom[data]'"


def resolve_files(cfg: Any) -> list[SourceFile]:
    """The sorted list of files a config (`source`, `paths`) reads; DataError for bad ones."""
    source = cfg.source
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r}; allowed: {', '.join(SOURCES)}")
    if source == "stdlib":
        if cfg.paths:
            logger.warning("data.source is 'stdlib'; ignoring data.paths=%s", list(cfg.paths))
        return stdlib_files()
    if source == "megatron":
        from hyperloom.data.megatron import megatron_files

        return megatron_files(cfg.paths)
    return files_under(cfg.paths, SUFFIXES[source], source)


def source_fingerprint(source: str, files: list[SourceFile]) -> list[tuple[str, int, int]]:
    """`file_fingerprint` of every file a source reads (a Megatron .idx and its .bin)."""
    if source != "megatron":
        return file_fingerprint(files)
    bins = [SourceFile(f.path.with_suffix(".bin"), f.name) for f in files]
    return file_fingerprint([g for pair in zip(files, bins, strict=True) for g in pair])


def file_documents(
    source: str, f: SourceFile, text_field: str, eos_token: str
) -> Iterator[Document]:
    """The documents of one file of a text source, in order, one at a time."""
    try:
        if source == "stdlib":
            yield from stdlib_documents(f)
        elif source == "text":
            yield from text_documents(f, eos_token)
        elif source == "jsonl":
            yield from jsonl_documents(f, text_field)
        elif source in ("parquet", "arrow"):
            for row, text in column_values(source, f.path, text_field):
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DataError(
                        f"{source} file {str(f.path)!r}: column {text_field!r} holds "
                        f"{type(text).__name__} values, expected strings"
                    )
                if text.strip():
                    yield Document(f"{f.name}#{row}", text)
        else:
            raise DataError(f"data source {source!r} holds token ids, not text")
    except OSError as exc:  # unreadable: permissions, a directory, an I/O error
        raise DataError(f"cannot read data file {str(f.path)!r}: {exc.strerror or exc}") from None


def load_documents(cfg: Any, files: list[SourceFile] | None = None) -> list[Document]:
    """Every document of a small corpus, in file order, as a list (a build streams them)."""
    files = resolve_files(cfg) if files is None else files
    docs = [d for f in files for d in file_documents(cfg.source, f, cfg.text_field, cfg.eos_token)]
    if not docs:
        raise DataError(empty_corpus(cfg.source, files))
    return docs


def empty_corpus(source: str, files: list[SourceFile]) -> str:
    names = ", ".join(repr(str(f.path)) for f in files[:3]) + (", ..." if len(files) > 3 else "")
    return f"the {source!r} corpus is empty: no text found in {names}"


# --- Parquet and Arrow -------------------------------------------------------------------------


def _pyarrow(source: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"data source {source!r} needs pyarrow; {ARROW_EXTRA}") from None
    return pa, pq


def column_values(source: str, path: Path, field: str) -> Iterator[tuple[int, Any]]:
    """(row, value) of one column of a Parquet or Arrow file, a record batch at a time;
    DataError naming the file and the columns it has for a missing column or a bad file."""
    pa, pq = _pyarrow(source)
    try:
        if source == "parquet":
            pf = pq.ParquetFile(path)
            _check_column(source, path, field, pf.schema_arrow.names)
            batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=[field])
        else:
            batches = _arrow_batches(pa, path, field)
        row = 0
        for batch in batches:
            for value in batch.column(field).to_pylist():
                yield row, value
                row += 1
    except DataError:
        raise
    except (pa.ArrowException, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"cannot read {source} file {str(path)!r}: {exc}") from None


def _arrow_batches(pa, path: Path, field: str) -> Iterator[Any]:
    """Record batches of an Arrow IPC file: the stream format `datasets` writes, or the
    random-access file format."""
    with pa.OSFile(str(path), "rb") as fh:
        try:
            reader = pa.ipc.open_stream(fh)
        except pa.ArrowInvalid:
            fh.seek(0)
            reader = pa.ipc.open_file(fh)
            _check_column("arrow", path, field, reader.schema.names)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i).select([field])
            return
        _check_column("arrow", path, field, reader.schema.names)
        for batch in reader:
            yield batch.select([field])


def _check_column(source: str, path: Path, field: str, names: list[str]) -> None:
    if field not in names:
        have = ", ".join(names) or "none"
        raise DataError(
            f"{source} file {str(path)!r} has no column {field!r} (columns: {have}); name "
            f"the column in data.text_field (data.messages_field for sft data, a blend "
            f"entry's text_field in a blend)"
        )
