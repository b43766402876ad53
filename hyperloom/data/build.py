"""build_data: config -> tokenizer + packed train/val token streams, cached on disk.

Building is slow and later runs should be fast, so the results (tokenizer.json, train.npy,
val.npy, info.json) live in a folder named by a hash of everything that determines them (the
sources, their file lists with sizes and mtimes, split, subset, vocabulary, eos, tokenizer
and `tokenizers` version; not a blend's weights, which only the loader reads); nothing is
invalidated in place. The corpus is streamed (`stream`): read in a census pass, tokenized by
worker processes and appended to the token files on disk, so it may be larger than memory,
and the files are identical for any number of workers. Files are written to temporary names
and moved into place with `os.replace`, `info.json` last, so concurrent processes see a whole
cache or none, and racing builders write identical bytes. A folder whose files do not load
back whole (a truncated token file) is built again, with a warning: all of it is derived.

A blend (`data.source = "blend"`) packs its sources one after another, each its own segment
of both files (`blend.Segment`), split and subset on its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from hyperloom.data.blend import Segment
from hyperloom.data.corpus import SourceFile, file_fingerprint
from hyperloom.data.dataset import TokenDataset
from hyperloom.data.errors import DataError, fmt_int
from hyperloom.data.pool import resolve_workers
from hyperloom.data.progress import byte_progress
from hyperloom.data.readers import resolve_files
from hyperloom.data.stream import (
    Source,
    TokenWriter,
    cache_write_error,
    choose_all,
    encode_sources,
    log_encoded,
    take_census,
    tokenizer_sample,
)
from hyperloom.data.tokenizer import TRAIN_CAP_MB, Tokenizer, token_dtype, tokenizer_file, train_bpe

logger = logging.getLogger("hyperloom.data")

FORMAT_VERSION = 2  # bump when the cached layout or packing scheme changes (2: blends, streams)


@dataclass
class DataBundle:
    """Everything training needs from the data: the tokenizer and the two packed splits."""

    tokenizer: Tokenizer
    train: TokenDataset
    val: TokenDataset
    corpus_info: dict[str, Any]


def cache_root(cfg: Any) -> Path:
    """cfg.cache_dir, else $HYPERLOOM_CACHE, else ~/.cache/hyperloom."""
    root = cfg.cache_dir or os.environ.get("HYPERLOOM_CACHE") or "~/.cache/hyperloom"
    return Path(root).expanduser()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_key(
    cfg: Any, files: Sequence[SourceFile], vocab_size: int, sources: Sequence[Source] = ()
) -> str:
    """Hex digest of every input that determines the cached tokenizer and token arrays:
    `files` and the config, and each of `sources` (kind, text field, files)."""
    user_tok = tokenizer_file(cfg.tokenizer).resolve() if cfg.tokenizer else None
    parts = {
        "format": FORMAT_VERSION,
        "source": cfg.source,
        "files": file_fingerprint(files),
        "sources": [[s.kind, s.text_field, s.fingerprint()] for s in sources],
        "text_field": cfg.text_field,
        "val_fraction": float(cfg.val_fraction),
        "max_corpus_mb": float(cfg.max_corpus_mb),
        "vocab_size": int(vocab_size),
        "eos_token": cfg.eos_token,
        "tokenizer": [str(user_tok), _sha256_file(user_tok)] if user_tok else None,
        "tokenizer_train_cap_mb": TRAIN_CAP_MB,
        "tokenizers_version": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _atomic_write(dest: Path, write: Callable[[Path], None]) -> None:
    """Run write(tmp) on a temp file next to `dest`, then atomically rename it into place."""
    try:
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            write(tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise cache_write_error(dest, exc) from None


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"cannot create the data cache {str(folder)!r}: {exc.strerror or exc}; "
            f"data.cache_dir (or $HYPERLOOM_CACHE) must be a writable directory"
        ) from None


def _save_npy(dest: Path, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        # A file handle, because np.save(path) would append ".npy" to the temp name.
        with open(tmp, "wb") as fh:
            np.save(fh, array)

    _atomic_write(dest, write)


def _load_user_tokenizer(cfg: Any, vocab_size: int) -> Tokenizer:
    tok = Tokenizer.load(cfg.tokenizer, cfg.eos_token)
    if tok.vocab_size > vocab_size:
        raise DataError(
            f"tokenizer {cfg.tokenizer!r} has {fmt_int(tok.vocab_size)} tokens but the model's "
            f"vocab_size is {fmt_int(vocab_size)}; set the model vocab_size to at least "
            f"{fmt_int(tok.vocab_size)} or use a smaller tokenizer"
        )
    return tok


def _check_fits(bundle: DataBundle, seq_len: int) -> None:
    """Both splits must hold at least one (seq_len + 1)-token window, and so must every
    source of a blend's training split (each is drawn from)."""
    for seg in bundle.train.segments or []:
        if seg.windows(seq_len) == 0:
            raise DataError(
                f"seq_len({seq_len}) is larger than blend source {seg.name!r} can fill: its "
                f"train split has {fmt_int(seg.stop - seg.start)} tokens and one sequence needs "
                f"seq_len + 1 = {fmt_int(seq_len + 1)}. Lower seq_len, add to that source, or "
                "leave it out of the blend."
            )
    for ds in (bundle.train, bundle.val):
        if ds.num_sequences(seq_len) == 0:
            docs = bundle.corpus_info[f"{ds.name}_documents"]
            raise DataError(
                f"seq_len({seq_len}) is larger than the {ds.name} split can fill: it has "
                f"{fmt_int(len(ds))} tokens in {fmt_int(docs)} document(s) and one sequence "
                f"needs seq_len + 1 = {fmt_int(seq_len + 1)}. Lower seq_len, or raise "
                "val_fraction / max_corpus_mb."
            )


class _Damaged(Exception):
    """A cache file that does not load back whole; the message names it."""


def _load_tokens(
    path: Path, name: str, expected: Any, segments: list[Segment] | None = None
) -> TokenDataset:
    """A cached token file, checked against info.json's count (its pages stay unread: a
    memory map costs page cache only as training reaches it)."""
    try:
        ds = TokenDataset.load(path, name, segments)
    except (OSError, ValueError, EOFError) as exc:  # truncated, not .npy, unreadable
        raise _Damaged(f"{path}: {exc}") from None
    if ds.tokens.dtype.kind != "u":
        raise _Damaged(f"{path}: token ids of dtype {ds.tokens.dtype}, expected unsigned")
    if len(ds) != expected:
        raise _Damaged(f"{path}: {fmt_int(len(ds))} tokens, info.json says {expected}")
    return ds


def entry_name(entry: Any) -> str:
    """A blend entry's label: its `name`, else source:first path."""
    return entry.name or f"{entry.source}:{Path(entry.paths[0]).name if entry.paths else ''}"


def _segments(info: dict[str, Any], cfg: Any, split: str) -> list[Segment] | None:
    """A blend's segments of one split, from info.json's per-source counts and the config's
    names and weights; None when the config is not a blend."""
    if cfg.source != "blend":
        return None
    rows = info.get("sources")
    if not isinstance(rows, list) or len(rows) != len(cfg.blend):
        raise _Damaged(f"info.json: per-source counts do not match the {len(cfg.blend)} sources")
    segments, start = [], 0
    for row, entry in zip(rows, cfg.blend, strict=True):
        stop = start + int(row[f"{split}_tokens"])
        segments.append(Segment(entry_name(entry), start, stop, float(entry.weight)))
        start = stop
    return segments


def _load_cached(folder: Path, cfg: Any, user_tok: Tokenizer | None) -> DataBundle:
    """The cached bundle; `_Damaged` naming the first file that does not load back whole."""
    try:
        info = json.loads((folder / "info.json").read_text())
    except (OSError, ValueError) as exc:
        raise _Damaged(f"{folder / 'info.json'}: {exc}") from None
    if not isinstance(info, dict):
        raise _Damaged(f"{folder / 'info.json'}: a JSON {type(info).__name__}, not an object")
    try:
        tok = user_tok or Tokenizer.load(folder / "tokenizer.json", cfg.eos_token)
    except DataError as exc:
        raise _Damaged(str(exc)) from None
    info["cache_hit"] = True
    try:
        train_seg, val_seg = _segments(info, cfg, "train"), _segments(info, cfg, "val")
    except (KeyError, TypeError, ValueError) as exc:
        raise _Damaged(f"{folder / 'info.json'}: per-source counts unreadable ({exc})") from None
    return DataBundle(
        tokenizer=tok,
        train=_load_tokens(folder / "train.npy", "train", info.get("train_tokens"), train_seg),
        val=_load_tokens(folder / "val.npy", "val", info.get("val_tokens"), val_seg),
        corpus_info=info,
    )


def _cached_tokenizer(path: Path, eos_token: str) -> Tokenizer | None:
    """The tokenizer a previous, interrupted build left, if it loads; else None (train one)."""
    if not path.is_file():
        return None
    try:
        tok = Tokenizer.load(path, eos_token)
    except DataError as exc:
        logger.warning("the cached tokenizer is damaged (%s); training it again", exc)
        return None
    logger.info("using cached tokenizer %s", path)
    return tok


def configured_sources(cfg: Any) -> list[Source]:
    """The corpora a config reads: itself, or each `[[data.blend]]` entry, files resolved."""
    if cfg.source != "blend":
        return [Source(cfg.source, cfg.source, resolve_files(cfg), cfg.text_field)]
    if not cfg.blend:
        raise DataError("data.source is 'blend' but there are no [[data.blend]] entries")
    sources = []
    for i, entry in enumerate(cfg.blend):
        try:
            files = resolve_files(entry)
        except DataError as exc:
            raise DataError(f"data.blend[{i}] ({entry_name(entry)}): {exc}") from None
        sources.append(
            Source(entry_name(entry), entry.source, files, entry.text_field, entry.weight)
        )
    return sources


def build_data(cfg: Any, vocab_size: int, progress: bool = False) -> DataBundle:
    """Read, split, tokenize and pack the configured corpus, or reuse the cached result.

    `vocab_size` is the model's vocabulary: the built-in tokenizer is trained to exactly
    that size, and a user tokenizer must not exceed it. `progress` draws progress bars while
    a cache is built. `source = "sft"` (conversations with answer-only labels) is
    `sft.build_sft_data`'s.
    """
    if cfg.source == "sft":
        from hyperloom.data.sft import build_sft_data  # it builds on this module's helpers

        return build_sft_data(cfg, vocab_size)
    sources = configured_sources(cfg)
    # Load a user tokenizer first: a bad tokenizer should fail before minutes of reading.
    user_tok = _load_user_tokenizer(cfg, vocab_size) if cfg.tokenizer else None
    if user_tok is None and any(s.kind == "megatron" for s in sources):
        raise DataError(
            "a megatron dataset holds token ids of the tokenizer it was made with; set "
            "data.tokenizer to that tokenizer.json"
        )
    folder = cache_root(cfg) / f"data-{cache_key(cfg, [], vocab_size, sources)[:20]}"
    _make_folder(folder)

    def build() -> None:
        info = _build(cfg, sources, folder, user_tok, vocab_size, progress)
        # Written last: its presence is what marks the folder as complete.
        _atomic_write(folder / "info.json", lambda p: p.write_text(json.dumps(info, indent=2)))

    bundle = cached_bundle(
        folder, "tokenizer and token arrays", lambda: _load_cached(folder, cfg, user_tok), build
    )
    _check_fits(bundle, cfg.seq_len)
    return bundle


def cached_bundle(
    folder: Path, what: str, load: Callable[[], Any], build: Callable[[], None]
) -> Any:
    """The bundle cached in `folder` (`load`), or `build` it there (info.json written last)
    and read it back; a cache that does not load whole is built again, with a warning."""
    if (folder / "info.json").is_file():
        logger.info("using cached %s from %s", what, folder)
        try:
            return load()
        except _Damaged as exc:
            logger.warning("the data cache is damaged (%s); building it again", exc)
    build()
    try:
        bundle = load()
    except _Damaged as exc:  # what was just written does not read back: the disk is at fault
        raise DataError(f"the data cache just written does not read back: {exc}") from None
    bundle.corpus_info["cache_hit"] = False
    return bundle


def _build(
    cfg: Any,
    sources: list[Source],
    folder: Path,
    user_tok: Tokenizer | None,
    vocab_size: int,
    progress: bool,
) -> dict[str, Any]:
    """Census, tokenizer, tokens: the cache folder's files but info.json, whose dict it returns."""
    t0 = time.perf_counter()
    on_disk = sum(f.path.stat().st_size for s in sources for f in s.files)
    with byte_progress("reading", on_disk, progress) as advance:
        censuses = [take_census(s, cfg.eos_token, advance) for s in sources]
    choose_all(sources, censuses, cfg.max_corpus_mb, cfg.val_fraction)
    counts = [c.counts() for c in censuses]
    chosen = sum(n["bytes"] for n in counts)
    logger.info(
        "read %s documents (%.1f MB chosen) from %s file(s) in %.1f s",
        fmt_int(sum(n["documents"] for n in counts)),
        chosen / 1e6,
        fmt_int(sum(len(s.files) for s in sources)),
        time.perf_counter() - t0,
    )
    tok = user_tok or _cached_tokenizer(folder / "tokenizer.json", cfg.eos_token)
    if tok is None:
        docs = tokenizer_sample(sources, censuses, cfg.eos_token, TRAIN_CAP_MB)
        tok = train_bpe(docs, vocab_size, cfg.eos_token)
        _atomic_write(folder / "tokenizer.json", tok.save)

    t0 = time.perf_counter()
    dtype = token_dtype(tok.vocab_size)
    writers = (TokenWriter(folder / "train.npy", dtype), TokenWriter(folder / "val.npy", dtype))
    try:
        with byte_progress("tokenizing", chosen, progress) as advance:
            stats, workers = encode_sources(
                sources, censuses, tok, writers, resolve_workers(cfg.workers), advance
            )
        train_tokens, val_tokens = writers[0].commit(), writers[1].commit()
    finally:
        for w in writers:
            w.discard()
    log_encoded(stats, chosen, time.perf_counter() - t0, workers)
    return {
        "source": cfg.source,
        "files": sum(len(s.files) for s in sources),
        **{key: sum(n[key] for n in counts) for key in counts[0]},
        "train_tokens": train_tokens,
        "val_tokens": val_tokens,
        "tokenizer": str(cfg.tokenizer) if cfg.tokenizer else "built-in byte-level BPE",
        "vocab_size": tok.vocab_size,
        "cache_dir": str(folder),
        "sources": [
            {"name": s.name, "source": s.kind, "files": len(s.files), **n, **st}
            for s, n, st in zip(sources, counts, stats, strict=True)
        ],
    }
