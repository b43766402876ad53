"""build_data: config -> tokenizer + packed train/val token streams, cached on disk.

Building is slow and later runs should be fast, so the results (tokenizer.json, train.npy,
val.npy, info.json) live in a folder named by a hash of everything that determines them (the
source, the file list with sizes and mtimes, split, subset, vocabulary, eos, tokenizer and
`tokenizers` version); nothing is invalidated in place. Files are written to temporary names
and moved into place with `os.replace`, `info.json` last, so concurrent processes see a whole
cache or none, and racing builders write identical bytes. A folder whose files do not load
back whole (a truncated token file) is built again, with a warning: all of it is derived.
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

from hyperloom.data.corpus import (
    SourceFile,
    file_fingerprint,
    load_documents,
    resolve_files,
    select_subset,
    split_documents,
)
from hyperloom.data.dataset import TokenDataset
from hyperloom.data.errors import DataError, fmt_int
from hyperloom.data.tokenizer import (
    TRAIN_CAP_MB,
    Tokenizer,
    encode_documents,
    tokenizer_file,
    train_bpe,
)

logger = logging.getLogger("hyperloom.data")

FORMAT_VERSION = 1  # bump when the cached layout or packing scheme changes


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


def cache_key(cfg: Any, files: Sequence[SourceFile], vocab_size: int) -> str:
    """Hex digest of every input that determines the cached tokenizer and token arrays."""
    user_tok = tokenizer_file(cfg.tokenizer).resolve() if cfg.tokenizer else None
    parts = {
        "format": FORMAT_VERSION,
        "source": cfg.source,
        "files": file_fingerprint(files),
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
        raise DataError(
            f"cannot write the data cache file {str(dest)!r}: {exc.strerror or exc}; free space "
            f"there or point data.cache_dir (or $HYPERLOOM_CACHE) at a writable directory"
        ) from None


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
    """Both splits must hold at least one (seq_len + 1)-token window."""
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


def _load_tokens(path: Path, name: str, expected: Any) -> TokenDataset:
    """A cached token file, checked against info.json's count (its pages stay unread: a
    memory map costs page cache only as training reaches it)."""
    try:
        ds = TokenDataset.load(path, name)
    except (OSError, ValueError, EOFError) as exc:  # truncated, not .npy, unreadable
        raise _Damaged(f"{path}: {exc}") from None
    if ds.tokens.dtype.kind != "u":
        raise _Damaged(f"{path}: token ids of dtype {ds.tokens.dtype}, expected unsigned")
    if len(ds) != expected:
        raise _Damaged(f"{path}: {fmt_int(len(ds))} tokens, info.json says {expected}")
    return ds


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
    return DataBundle(
        tokenizer=tok,
        train=_load_tokens(folder / "train.npy", "train", info.get("train_tokens")),
        val=_load_tokens(folder / "val.npy", "val", info.get("val_tokens")),
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


def build_data(cfg: Any, vocab_size: int) -> DataBundle:
    """Read, split, tokenize and pack the configured corpus, or reuse the cached result.

    `vocab_size` is the model's vocabulary: the built-in tokenizer is trained to exactly
    that size, and a user tokenizer must not exceed it.
    """
    files = resolve_files(cfg)
    # Load a user tokenizer first: a bad tokenizer should fail before minutes of reading.
    user_tok = _load_user_tokenizer(cfg, vocab_size) if cfg.tokenizer else None
    folder = cache_root(cfg) / f"data-{cache_key(cfg, files, vocab_size)[:20]}"
    _make_folder(folder)
    if (folder / "info.json").is_file():
        logger.info("using cached tokenizer and token arrays from %s", folder)
        try:
            bundle = _load_cached(folder, cfg, user_tok)
        except _Damaged as exc:
            logger.warning("the data cache is damaged (%s); building it again", exc)
        else:
            _check_fits(bundle, cfg.seq_len)
            return bundle

    t0 = time.perf_counter()
    docs = select_subset(load_documents(cfg, files), cfg.max_corpus_mb)
    nbytes = sum(d.nbytes for d in docs)
    logger.info(
        "read %s documents (%.1f MB) from %s %r files in %.1f s",
        fmt_int(len(docs)),
        nbytes / 1e6,
        fmt_int(len(files)),
        cfg.source,
        time.perf_counter() - t0,
    )
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)

    tok_path = folder / "tokenizer.json"
    if user_tok is not None:
        tok = user_tok
    else:
        tok = _cached_tokenizer(tok_path, cfg.eos_token)
        if tok is None:
            tok = train_bpe(train_docs, vocab_size, cfg.eos_token)
            _atomic_write(tok_path, tok.save)

    t0 = time.perf_counter()
    train = encode_documents(tok, train_docs)
    val = encode_documents(tok, val_docs)
    logger.info(
        "tokenized %.1f MB into %s tokens (train %s, val %s) in %.1f s",
        nbytes / 1e6,
        fmt_int(len(train) + len(val)),
        fmt_int(len(train)),
        fmt_int(len(val)),
        time.perf_counter() - t0,
    )
    _save_npy(folder / "train.npy", train)
    _save_npy(folder / "val.npy", val)

    info = {
        "source": cfg.source,
        "files": len(files),
        "documents": len(docs),
        "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "bytes": nbytes,
        "tokenizer": str(cfg.tokenizer) if cfg.tokenizer else "built-in byte-level BPE",
        "vocab_size": tok.vocab_size,
        "cache_dir": str(folder),
    }
    # Written last: its presence is what marks the folder as complete.
    _atomic_write(folder / "info.json", lambda p: p.write_text(json.dumps(info, indent=2)))
    try:
        bundle = _load_cached(folder, cfg, user_tok)
    except _Damaged as exc:  # what was just written does not read back: the disk is at fault
        raise DataError(f"the data cache just written does not read back: {exc}") from None
    bundle.corpus_info["cache_hit"] = False
    _check_fits(bundle, cfg.seq_len)
    return bundle
