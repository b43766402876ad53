"""Tokenizer: a thin wrapper over HF `tokenizers`, and the built-in byte-level BPE trainer.

The built-in tokenizer is GPT-2-style byte-level BPE, so every string round-trips losslessly
(`add_prefix_space=False`; special tokens never added or skipped implicitly). It is trained on
the training split only, so validation documents do not leak through the merges, and on at
most `TRAIN_CAP_MB` of it, which keeps a first run quick.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from hyperloom.data.corpus import Document, budget_mask, units
from hyperloom.data.errors import DataError, fmt_int

logger = logging.getLogger("hyperloom.data")

TRAIN_CAP_MB = 8.0  # most training text the built-in BPE is trained on
_BYTE_ALPHABET = 256


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the id of the document separator (eos)."""

    def __init__(self, backend: HFTokenizer, eos_token: str = "<|endoftext|>") -> None:
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(
                f"eos token {eos_token!r} is not in the tokenizer's vocabulary "
                f"({fmt_int(backend.get_vocab_size())} tokens); set data.eos_token to the "
                "token this tokenizer uses to separate documents"
            )
        self.backend = backend
        self.eos_token = eos_token
        self.eos_id: int = eos_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts on the Rust thread pool (much faster than a Python loop)."""
        # encode_batch_fast (tokenizers >= 0.20) skips computing offsets we never use.
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as a `tokenizer.json` file (HF tokenizers format)."""
        self.backend.save(str(path))

    def to_json(self) -> bytes:
        """The bytes `save` writes, without a file (a checkpoint stores them as they are)."""
        return self.backend.to_str(pretty=True).encode("utf-8")

    @classmethod
    def load(cls, path: str | Path, eos_token: str = "<|endoftext|>") -> Tokenizer:
        path = tokenizer_file(path)
        if not path.is_file():
            raise DataError(
                f"tokenizer file {str(path)!r} does not exist (expected tokenizer.json)"
            )
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on parse errors
            reason = " ".join(str(e).split()) or type(e).__name__
            raise DataError(
                f"cannot read tokenizer {str(path)!r}: {reason} (expected a Hugging Face "
                f"tokenizer.json)"
            ) from None
        try:
            return cls(backend, eos_token)
        except DataError as e:
            raise DataError(f"tokenizer {str(path)!r}: {e}") from None

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}:{self.eos_id})"


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json a path names: the file itself, or the one in that directory."""
    path = Path(path).expanduser()
    return path / "tokenizer.json" if path.is_dir() else path


def _training_texts(docs: Sequence[Document], cap_mb: float) -> tuple[list[str], int]:
    """A deterministic subset of about `cap_mb` MB, sampled across the whole corpus, in the
    order of its hash."""
    if not docs:
        return [], 0
    keys = units([d.id for d in docs], "tokenizer")
    sizes = np.array([d.nbytes for d in docs], dtype=np.int64)
    chosen = np.flatnonzero(budget_mask(keys, sizes, int(cap_mb * 1e6)))
    chosen = chosen[np.argsort(keys[chosen], kind="stable")]
    return [docs[i].text for i in chosen], int(sizes[chosen].sum())


def train_bpe(
    docs: Sequence[Document], vocab_size: int, eos_token: str, cap_mb: float = TRAIN_CAP_MB
) -> Tokenizer:
    """Train a byte-level BPE with exactly `vocab_size` entries (eos included) on `docs`."""
    if vocab_size < _BYTE_ALPHABET + 1:
        raise DataError(
            f"vocab_size {vocab_size} is too small for the built-in byte-level BPE: it needs at "
            f"least {_BYTE_ALPHABET + 1} (256 byte symbols + the eos token)"
        )
    texts, nbytes = _training_texts(docs, cap_mb)
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Each merge joins at least one pair of the text, so there are at most nbytes merges; the
    # trainer sizes its tables by vocab_size, and a huge one would exhaust memory first.
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, _BYTE_ALPHABET + 1 + nbytes),
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    logger.info(
        "training tokenizer on %.1f MB (%s documents) to vocab %s ...",
        nbytes / 1e6,
        fmt_int(len(texts)),
        fmt_int(vocab_size),
    )
    t0 = time.perf_counter()
    backend.train_from_iterator(_batched(texts), trainer=trainer, length=len(texts))
    tok = Tokenizer(backend, eos_token)
    logger.info("trained tokenizer in %.1f s", time.perf_counter() - t0)
    if tok.vocab_size < vocab_size:
        # A tiny corpus can run out of pairs to merge; the model just has unused rows.
        logger.warning(
            "corpus too small for vocab %s: tokenizer stopped at %s tokens",
            fmt_int(vocab_size),
            fmt_int(tok.vocab_size),
        )
    return tok


def _batched(texts: Sequence[str], size: int = 256) -> Iterator[list[str]]:
    # Lists of strings let the Rust side count pairs in parallel within each batch.
    for i in range(0, len(texts), size):
        yield list(texts[i : i + size])


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: halves the cache for vocab <= 65536."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def encode_texts(tok: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """Tokenize texts and pack them into one 1-D array, each followed by eos."""
    return pack(tok.encode_batch(texts), tok.eos_id, token_dtype(tok.vocab_size))


def pack(id_lists: Sequence[Sequence[int]], eos_id: int, dtype: np.dtype) -> np.ndarray:
    """Token id lists joined into one array of `dtype`, each followed by `eos_id`."""
    out = np.empty(sum(len(ids) for ids in id_lists) + len(id_lists), dtype=dtype)
    at = 0
    for ids in id_lists:
        out[at : at + len(ids)] = ids
        at += len(ids)
        out[at] = eos_id
        at += 1
    return out
