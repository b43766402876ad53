"""Supervised fine-tuning data: chat conversations, learnt on the assistant's answers only.

Records are JSONL lines (or Parquet / Arrow rows, read by `readers`) whose
`data.messages_field` (default "messages") holds a conversation in the common chat format,
`[{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]`. Each is
rendered with the tokenizer's chat template the way transformers' `apply_chat_template`
renders it (`chat_template`) and tokenized whole, with character offsets; a token is an
answer token when its characters overlap an assistant answer (its end-of-turn included).
Each sample ends with eos, as a pretraining document does (added when the template does not
end with it), and that eos is not learnt.

The built-in tokenizer (no data.tokenizer) is the byte-level BPE trained on the rendered
training conversations; the template is then `chat_template.DEFAULT_TEMPLATE`.

The tokens, answer flags and sample lengths are cached like `build_data`'s token arrays, with
`build`'s helpers: a folder named by a hash of every input (the template's text and special
tokens included), files written atomically, info.json last; a damaged folder is built again.
They do not depend on seq_len: `sft_packing` packs them into rows at load time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from hyperloom.data.build import (
    DataBundle,
    _atomic_write,
    _cached_tokenizer,
    _Damaged,
    _load_cached,
    _load_tokens,
    _load_user_tokenizer,
    _make_folder,
    _save_npy,
    cache_key,
    cache_root,
    cached_bundle,
)
from hyperloom.data.chat_template import ChatTemplate, load_chat_template, token_mask
from hyperloom.data.corpus import (
    Document,
    SourceFile,
    _walk,
    files_under,
    jsonl_objects,
    select_subset,
    split_documents,
)
from hyperloom.data.errors import DataError, fmt_int
from hyperloom.data.readers import column_values
from hyperloom.data.sft_packing import SFTDataset
from hyperloom.data.tokenizer import Tokenizer, token_dtype, train_bpe

logger = logging.getLogger("hyperloom.data")

FORMAT_VERSION = 1  # bump when the rendering, masking or cached layout changes
ROLES = ("system", "user", "assistant", "tool")
_SUFFIXES = (".jsonl", ".parquet", ".arrow")


# --- records -----------------------------------------------------------------------------------


def sft_files(paths: Sequence[str]) -> list[SourceFile]:
    """Files as named (`.parquet` and `.arrow` read with pyarrow, anything else as JSONL);
    directories give their *.jsonl, *.parquet and *.arrow files, recursively, sorted."""
    files: list[SourceFile] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.is_dir():
            files += files_under([raw], ".jsonl", "sft")  # a missing path is its error
            continue
        found = sorted(
            (f for s in _SUFFIXES for f in _walk(path.resolve(), s)), key=lambda f: f.name
        )
        if not found:
            raise DataError(f"directory {str(raw)!r} has no *.jsonl, *.parquet or *.arrow files")
        files += found
    return files or files_under(paths, ".jsonl", "sft")  # no paths: files_under says so


def _raw_records(f: SourceFile, field: str) -> Iterator[tuple[str, str, Any]]:
    """(stable key, where for messages, the field's value) of each record of one file."""
    kind = f.path.suffix[1:]
    if kind in ("parquet", "arrow"):
        for row, value in column_values(kind, f.path, field):
            yield f"{f.name}#{row}", f"{kind} row {row} of file {str(f.path)!r}", value
        return
    for line_no, where, record in jsonl_objects(f.path):
        if field not in record:
            keys = ", ".join(sorted(record)) or "none"
            raise DataError(
                f"{where} lacks field {field!r} (fields present: {keys}); set data.messages_field"
            )
        yield f"{f.name}#{line_no}", where, record[field]


def check_messages(value: Any, field: str, where: str) -> list[dict[str, Any]]:
    """The conversation, or DataError naming what is wrong with it."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: field {field!r} must be a non-empty list of messages "
            '({"role": ..., "content": ...})'
        )
    for k, m in enumerate(value, start=1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {k} must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {k} has role {m['role']!r}; allowed: {ROLES}")
        if not isinstance(m["content"], str):
            raise DataError(
                f"{where}: message {k}'s content is a {type(m['content']).__name__}, "
                "expected a string"
            )
    if not any(m["role"] == "assistant" for m in value):
        raise DataError(f"{where}: no 'assistant' message, so nothing to learn")
    return value


def read_conversations(cfg: Any, files: Sequence[SourceFile]) -> list[tuple[str, str, list]]:
    """(key, where, messages) of every record, in file order."""
    out = []
    for f in files:
        try:
            for key, where, value in _raw_records(f, cfg.messages_field):
                out.append((key, where, check_messages(value, cfg.messages_field, where)))
        except OSError as exc:
            raise DataError(
                f"cannot read data file {str(f.path)!r}: {exc.strerror or exc}"
            ) from None
    if len(out) < 2:
        raise DataError(
            f"the sft data has {len(out)} conversation(s); at least 2 are needed to hold one out "
            "for validation"
        )
    return out


# --- tokens and the answer mask ----------------------------------------------------------------


@dataclass
class Encoded:
    """One split's samples: token ids and answer flags joined, and each sample's length."""

    tokens: np.ndarray  # (total,) unsigned ids
    mask: np.ndarray  # (total,) uint8: 1 = an answer token (learnt)
    lengths: np.ndarray  # (samples,) uint32
    where: list[str]  # per sample, for messages


def encode_samples(
    tok: Tokenizer, docs: Sequence[Document], spans: dict[str, list], chunk: int = 512
) -> Encoded:
    """Tokenize rendered samples (`spans[doc.id]` = (answer spans, where)) with offsets, flag
    the answer tokens, and end each sample with eos."""
    dtype = token_dtype(tok.vocab_size)
    tokens, masks, lengths, wheres = [], [], [], []
    for i in range(0, len(docs), chunk):
        part = docs[i : i + chunk]
        for doc, enc in zip(
            part,
            tok.backend.encode_batch([d.text for d in part], add_special_tokens=False),
            strict=True,
        ):
            answer_spans, where = spans[doc.id]
            ids = list(enc.ids)
            mask = token_mask(enc.offsets, answer_spans)
            if not mask[1:].any():
                raise DataError(f"{where}: no answer token to learn once tokenized")
            if ids[-1] != tok.eos_id:  # a sample ends with eos, as a pretraining document does
                ids.append(tok.eos_id)
                mask = np.append(mask, False)
            tokens.append(np.asarray(ids, dtype=dtype))
            masks.append(mask.astype(np.uint8))
            lengths.append(len(ids))
            wheres.append(where)
    return Encoded(
        np.concatenate(tokens), np.concatenate(masks), np.asarray(lengths, np.uint32), wheres
    )


# --- build and cache ---------------------------------------------------------------------------


def sft_cache_key(cfg: Any, files: Sequence[SourceFile], vocab_size: int, tpl: ChatTemplate) -> str:
    """`build.cache_key`'s inputs plus what SFT adds: the field, the template, jinja2."""
    extra = [FORMAT_VERSION, cfg.messages_field, tpl.identity, jinja2.__version__]
    blob = json.dumps([cache_key(cfg, files, vocab_size), extra])
    return hashlib.sha256(blob.encode()).hexdigest()


def _build(
    cfg: Any,
    folder: Path,
    files: Sequence[SourceFile],
    tpl: ChatTemplate,
    user_tok: Tokenizer | None,
    vocab_size: int,
) -> None:
    """Read, render, split, tokenize and write the cache folder (info.json last)."""
    t0 = time.perf_counter()
    spans, docs = {}, []
    for key, where, messages in read_conversations(cfg, files):
        text, answer_spans = tpl.render_answers(messages, where)
        if not answer_spans:
            raise DataError(f"{where}: the chat template renders no answer text to learn")
        spans[key] = (answer_spans, where)
        docs.append(Document(key, text))
    docs = select_subset(docs, cfg.max_corpus_mb)
    logger.info(
        "rendered %s conversations from %s file(s) with the chat template (%s) in %.1f s",
        fmt_int(len(docs)),
        fmt_int(len(files)),
        tpl.origin,
        time.perf_counter() - t0,
    )
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    tok = user_tok or _cached_tokenizer(folder / "tokenizer.json", cfg.eos_token)
    if tok is None:
        tok = train_bpe(train_docs, vocab_size, cfg.eos_token)
        _atomic_write(folder / "tokenizer.json", tok.save)
    info: dict[str, Any] = {"source": "sft", "files": len(files), "documents": len(docs)}
    wheres = {}
    for name, split in (("train", train_docs), ("val", val_docs)):
        enc = encode_samples(tok, split, spans)
        _save_npy(folder / f"{name}.npy", enc.tokens)
        _save_npy(folder / f"{name}_mask.npy", enc.mask)
        _save_npy(folder / f"{name}_lengths.npy", enc.lengths)
        wheres[name] = enc.where
        info[f"{name}_documents"] = len(split)
        info[f"{name}_tokens"] = int(len(enc.tokens))
        info[f"{name}_answer_tokens"] = int(enc.mask.sum())
    _atomic_write(folder / "samples.json", lambda p: p.write_text(json.dumps(wheres)))
    info |= {
        "template": tpl.origin,
        "tokenizer": str(cfg.tokenizer) if cfg.tokenizer else "built-in byte-level BPE",
        "vocab_size": tok.vocab_size,
        "cache_dir": str(folder),
    }
    _atomic_write(folder / "info.json", lambda p: p.write_text(json.dumps(info, indent=2)))


class _Where:
    """Sample i of a split -> where it came from, read from samples.json when first asked."""

    def __init__(self, path: Path, split: str) -> None:
        self.path, self.split = path, split

    @cached_property
    def _names(self) -> list[str]:
        try:
            return json.loads(self.path.read_text())[self.split]
        except (OSError, ValueError, KeyError):
            return []

    def __call__(self, i: int) -> str:
        names = self._names
        return names[i] if i < len(names) else f"{self.split} sample {i}"


def _load(cfg: Any, folder: Path, user_tok: Tokenizer | None) -> DataBundle:
    """The cached SFT bundle; `_Damaged` naming the first file that does not load back whole."""
    base = _load_cached(folder, cfg, user_tok)  # info.json, the tokenizer, the token arrays
    info = base.corpus_info
    splits = {}
    for name, tokens in (("train", base.train.tokens), ("val", base.val.tokens)):
        mask = _load_tokens(folder / f"{name}_mask.npy", name, len(tokens)).tokens
        lengths = _load_tokens(folder / f"{name}_lengths.npy", name, info.get(f"{name}_documents"))
        if int(lengths.tokens.sum(dtype=np.int64)) != len(tokens):
            raise _Damaged(f"{folder / f'{name}_lengths.npy'}: lengths do not sum to the tokens")
        splits[name] = SFTDataset(
            name,
            tokens,
            mask,
            lengths.tokens,
            pad_id=base.tokenizer.eos_id,
            overflow=cfg.sft_overflow,
            where=_Where(folder / "samples.json", name),
        )
    return DataBundle(base.tokenizer, splits["train"], splits["val"], info)


def build_sft_data(cfg: Any, vocab_size: int) -> DataBundle:
    """Conversations -> tokenizer and packed train/val `SFTDataset`s, cached on disk.

    Packed for `cfg.seq_len` before returning, so a sample too long under
    `sft_overflow = "error"`, or a split that loses every sample, fails here. The config is
    duck-typed: any object with the `DataConfig` attributes works.
    """
    files = sft_files(cfg.paths)
    user_tok = _load_user_tokenizer(cfg, vocab_size) if cfg.tokenizer else None
    tpl = load_chat_template(cfg.chat_template, cfg.tokenizer or None, cfg.eos_token)
    folder = cache_root(cfg) / f"sft-{sft_cache_key(cfg, files, vocab_size, tpl)[:20]}"
    _make_folder(folder)
    bundle = cached_bundle(
        folder,
        "sft data",
        lambda: _load(cfg, folder, user_tok),
        lambda: _build(cfg, folder, files, tpl, user_tok, vocab_size),
    )
    info = bundle.corpus_info
    for ds in (bundle.train, bundle.val):
        p = ds.packing(cfg.seq_len)
        info |= {
            f"{ds.name}_rows": p.rows,
            f"{ds.name}_labels": p.labels,
            f"{ds.name}_truncated": p.truncated,
            f"{ds.name}_dropped": p.dropped,
        }
    pack = bundle.train.packing(cfg.seq_len)
    row_tokens = pack.rows * (cfg.seq_len + 1)
    logger.info(
        "sft data: %s train / %s val samples in %s / %s rows of seq_len + 1 = %d tokens; "
        "%.0f%% of the train rows are sample tokens, %.0f%% labelled answer tokens",
        fmt_int(len(bundle.train)),
        fmt_int(len(bundle.val)),
        fmt_int(info["train_rows"]),
        fmt_int(info["val_rows"]),
        cfg.seq_len + 1,
        100 * pack.tokens / row_tokens,
        100 * pack.labels / row_tokens,
    )
    return bundle
