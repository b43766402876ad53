"""`hyperloom data prepare [CONFIG] [--section.key value ...]`: build a job's data cache.

A corpus at real scale takes a while to read, split and tokenize. Preparing it first (on a CPU
machine, or once before a multi-node job) leaves the cache folder whole, and the training job
then only memory-maps it: the folder is named by the same inputs `hyperloom train` hashes,
from the same TOML file and overrides. `--data.workers N` sets the tokenizer processes. The
table it prints says what was built: documents and tokens per split, per source for a blend,
and the throughput.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

from hyperloom.data.build import build_data
from hyperloom.data.errors import DataError, fmt_int

_IMAGE_SOURCES = ("scenes", "llava")


def prepare(cfg: Any, out: Console) -> int:
    """Build (or find) the cache of a validated job's data and print what it holds on `out`."""
    if cfg.data.source in _IMAGE_SOURCES:
        raise DataError(
            f"data.source = '{cfg.data.source}' is image-text data, prepared when training "
            "starts; `data prepare` builds the text sources' caches"
        )
    t0 = time.perf_counter()
    bundle = build_data(cfg.data, cfg.model.vocab_size, progress=cfg.logging.progress)
    seconds = time.perf_counter() - t0
    info = bundle.corpus_info
    out.print(summary_table(info, seconds))
    if cfg.data.source == "blend":
        out.print(sources_table(info, bundle.train.segments or []))
    return 0


def summary_table(info: dict[str, Any], seconds: float) -> Table:
    table = Table(title="hyperloom data prepare", show_header=False, title_style="bold")
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = {
        "source": info.get("source"),
        "files": fmt_int(info.get("files", 0)),
        "documents": f"{fmt_int(info['train_documents'])} train, "
        f"{fmt_int(info['val_documents'])} val",
        "tokens": f"{fmt_int(info['train_tokens'])} train, {fmt_int(info['val_tokens'])} val",
        "text": f"{info.get('bytes', 0) / 1e6:,.1f} MB",
        "tokenizer": f"{info['tokenizer']} ({fmt_int(info['vocab_size'])} tokens)",
        "cache": info["cache_dir"],
        "built": "no: found in the cache" if info.get("cache_hit") else f"in {seconds:,.1f} s",
    }
    for key, value in rows.items():
        table.add_row(key, str(value))
    return table


def sources_table(info: dict[str, Any], segments: list) -> Table:
    table = Table(title="blend sources", title_style="bold")
    for column in ("source", "kind", "weight", "documents", "train tokens", "val tokens"):
        table.add_column(column, justify="left" if column in ("source", "kind") else "right")
    total = sum(s.weight for s in segments) or 1.0
    for row, seg in zip(info.get("sources", []), segments, strict=False):
        table.add_row(
            seg.name,
            row["source"],
            f"{seg.weight / total:.3f}",
            fmt_int(row["documents"]),
            fmt_int(row["train_tokens"]),
            fmt_int(row["val_tokens"]),
        )
    return table
