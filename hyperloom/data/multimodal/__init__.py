"""hyperloom.data.multimodal: image-text data for the vision-language family ("vlm").

    data = build_multimodal_data(cfg.data, vocab_size=m.vocab_size, image_size=m.image_size,
                                 image_token_id=m.image_token_id,
                                 tokens_per_image=tokens_per_image(m))
    loader = MultimodalLoader(data.train, batch_size, cfg.data.seq_len, seed)
    inputs, labels = loader.next_batch()   # ImageTokens(tokens, images), labels
    evals = multimodal_val_batches(data.val, batch_size, cfg.data.seq_len, n_batches=10)
    items = eval_prompts(data.val, 200)    # generate from item.prompt, then:
    report = score_answers(items, predictions)   # {"accuracy", "chance", "by_task"}

Two sources: `scenes`, a built-in deterministic set of shapes and text drawn on the fly (see
`scenes`), and `llava`, LLaVA JSONL files with image files (see `llava`). Rows follow the
LLaVA-1.5 template `USER: <image>\\n{question} ASSISTANT: {answer}<eos>` (see `dataset`).

The tokenizer. A user's `data.tokenizer` is used as it is. Otherwise the repository's byte-level
BPE is trained on the training conversations (the first `TOKENIZER_SAMPLES` of the scenes train
split, or the llava train split) to `image_token_id` entries, eos included; then reserved
special tokens fill any ids the corpus was too small to reach, and `<image>` is appended as a
special token, so its id is exactly `image_token_id` (LLaVA's own layout: a vocabulary, then
`<image>` at its end). Ids above it are unused rows of the model. The trained tokenizer is
cached in `cache_root(cfg)/vlm-tokenizer-<hash>/` keyed by everything that determines it, and
written atomically; only the tokenizer is cached: the text is tokenized again per build (a
second or two), the images never stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken

from hyperloom.data.build import (
    _atomic_write,
    _cached_tokenizer,
    _load_user_tokenizer,
    _make_folder,
    cache_root,
)
from hyperloom.data.corpus import Document, file_fingerprint, split_documents
from hyperloom.data.errors import DataError, fmt_int
from hyperloom.data.multimodal import scenes
from hyperloom.data.multimodal.dataset import (
    CLIP_MEAN,
    CLIP_STD,
    IGNORE_INDEX,
    IMAGE_MARKER,
    Conversation,
    EvalItem,
    ImageLoader,
    MultimodalDataset,
    MultimodalLoader,
    MultimodalSample,
    conversation_text,
    eval_prompts,
    multimodal_val_batches,
    score_answers,
)
from hyperloom.data.multimodal.llava import LlavaImages, read_llava, resolve_llava_files
from hyperloom.data.tokenizer import TRAIN_CAP_MB, Tokenizer, tokenizer_file, train_bpe

logger = logging.getLogger("hyperloom.data")

SOURCES = ("scenes", "llava")
FORMAT_VERSION = 1  # bump when the tokenizer recipe changes
TOKENIZER_SAMPLES = 4000  # scenes conversations the built-in BPE is trained on
MIN_SCENE_VAL = 256  # the scenes val split: max(this, val_fraction * scene_samples)
_BPE_MIN = 257  # 256 byte symbols + eos


@dataclass
class MultimodalData:
    """The tokenizer, the two splits and a summary (`info`) for logs and run reports."""

    tokenizer: Tokenizer
    train: MultimodalDataset
    val: MultimodalDataset
    info: dict[str, Any]


# --- tokenizer ---------------------------------------------------------------------------------


def with_image_token(tok: Tokenizer, image_token_id: int) -> Tokenizer:
    """`tok` with `<image>` at id `image_token_id`, appending it (after reserved fillers) if
    absent; DataError if the tokenizer puts it, or another token, at a different id."""
    backend = tok.backend
    have = backend.token_to_id(IMAGE_MARKER)
    if have is None:
        n = tok.vocab_size
        if n > image_token_id:
            taken = backend.id_to_token(image_token_id)
            raise DataError(
                f"the tokenizer has {fmt_int(n)} tokens and no {IMAGE_MARKER!r}; id "
                f"{image_token_id} (model.image_token_id) is already {taken!r}. Set "
                f"model.image_token_id to {n} (appended after the vocabulary) or use a "
                f"tokenizer that has {IMAGE_MARKER!r} at id {image_token_id}."
            )
        fillers = [AddedToken(f"<|reserved_{k}|>", special=True) for k in range(n, image_token_id)]
        backend.add_special_tokens([*fillers, AddedToken(IMAGE_MARKER, special=True)])
        tok = Tokenizer(backend, tok.eos_token)
        have = backend.token_to_id(IMAGE_MARKER)
    if have != image_token_id:
        raise DataError(
            f"the tokenizer maps {IMAGE_MARKER!r} to id {have} but model.image_token_id is "
            f"{image_token_id}; set model.image_token_id = {have}"
        )
    return tok


def _check_vocab(tok: Tokenizer, vocab_size: int, what: str) -> None:
    if tok.vocab_size > vocab_size:
        raise DataError(
            f"{what} has {fmt_int(tok.vocab_size)} tokens but the model's vocab_size is "
            f"{fmt_int(vocab_size)}; set the model vocab_size to at least "
            f"{fmt_int(tok.vocab_size)} or use a smaller tokenizer"
        )


def _train_tokenizer(
    cfg: Any, convs: Sequence[Conversation], key_parts: dict, vocab_size: int, image_token_id: int
) -> tuple[Tokenizer, str]:
    """The built-in BPE on `convs` with `<image>` at image_token_id, cached by `key_parts`."""
    if image_token_id < _BPE_MIN:
        raise DataError(
            f"model.image_token_id ({image_token_id}) leaves no room for the built-in "
            f"byte-level BPE below it: ids 0..{_BPE_MIN - 1} are the 256 byte symbols and eos. "
            f"Set model.image_token_id to at least {_BPE_MIN} (vocab_size - 1 = "
            f"{vocab_size - 1} is the usual choice)."
        )
    parts = {
        **key_parts,
        "format": FORMAT_VERSION,
        "vocab_size": int(vocab_size),
        "image_token_id": int(image_token_id),
        "eos_token": cfg.eos_token,
        "tokenizer_train_cap_mb": TRAIN_CAP_MB,
        "tokenizers_version": tokenizers.__version__,
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    folder = cache_root(cfg) / f"vlm-tokenizer-{key[:20]}"
    path = folder / "tokenizer.json"
    tok = _cached_tokenizer(path, cfg.eos_token)
    if tok is not None:
        try:
            return with_image_token(tok, image_token_id), str(path)
        except DataError as exc:
            logger.warning("the cached tokenizer is damaged (%s); training it again", exc)
    _make_folder(folder)
    docs = [Document(f"{i}", conversation_text(c)) for i, c in enumerate(convs)]
    tok = with_image_token(train_bpe(docs, image_token_id, cfg.eos_token), image_token_id)
    _atomic_write(path, tok.save)
    if image_token_id < vocab_size - 1:
        logger.info(
            "%s ids above image_token_id %d are unused rows of the model's vocabulary",
            fmt_int(vocab_size - 1 - image_token_id),
            image_token_id,
        )
    return tok, str(path)


def _tokenizer(
    cfg: Any, convs: Sequence[Conversation], key_parts: dict, vocab_size: int, image_token_id: int
) -> tuple[Tokenizer, str]:
    if cfg.tokenizer:
        tok = with_image_token(_load_user_tokenizer(cfg, vocab_size), image_token_id)
        where = str(tokenizer_file(cfg.tokenizer))
    else:
        tok, where = _train_tokenizer(cfg, convs, key_parts, vocab_size, image_token_id)
    _check_vocab(tok, vocab_size, f"tokenizer {where!r}")
    return tok, where


# --- sources -----------------------------------------------------------------------------------


def _scene_conversations(samples: Sequence[scenes.SceneSample], split: str) -> list[Conversation]:
    out = []
    for i, s in enumerate(samples):
        k = len(s.pictures)
        human = (IMAGE_MARKER * k + "\n" if k else "") + s.question
        where = f"scenes {split} sample {i} ({s.task})"
        out.append(Conversation(((human, s.answer),), s.task, s.chance, where))
    return out


def _scene_images(samples: Sequence[scenes.SceneSample], image_size: int) -> ImageLoader:
    return lambda i: samples[i].images(image_size)


def _build_scenes(cfg: Any, image_size: int) -> dict[str, Any]:
    scenes.check_image_size(image_size)
    n_train = int(cfg.scene_samples)
    n_val = max(MIN_SCENE_VAL, round(cfg.val_fraction * n_train))
    max_images = int(cfg.max_images)
    t0 = time.perf_counter()
    train = scenes.scene_samples(scenes.TRAIN, n_train, max_images)
    val = scenes.scene_samples(scenes.VAL, n_val, max_images)
    logger.info(
        "drew %s train and %s val scenes samples in %.1f s",
        fmt_int(n_train),
        fmt_int(n_val),
        time.perf_counter() - t0,
    )
    tok_samples = train[:TOKENIZER_SAMPLES]
    if len(tok_samples) < TOKENIZER_SAMPLES:  # the tokenizer does not depend on scene_samples
        tok_samples = scenes.scene_samples(scenes.TRAIN, TOKENIZER_SAMPLES, max_images)
    gen = f"scenes v{scenes.GENERATOR_VERSION} max_images={min(max_images, 2)}"
    return {
        "train": _scene_conversations(train, "train"),
        "val": _scene_conversations(val, "val"),
        "train_images": _scene_images(train, image_size),
        "val_images": _scene_images(val, image_size),
        "tokenizer_convs": _scene_conversations(tok_samples, "train"),
        "key": {"source": "scenes", "generator": gen, "samples": TOKENIZER_SAMPLES},
        "fingerprint": {
            "train": f"{gen} seed={scenes.TRAIN.seed} n={n_train}",
            "val": f"{gen} seed={scenes.VAL.seed} n={n_val}",
        },
    }


def _build_llava(cfg: Any, image_size: int) -> dict[str, Any]:
    files = resolve_llava_files(cfg)
    max_images = int(cfg.max_images)
    t0 = time.perf_counter()
    records = read_llava(cfg, files, max_images)
    docs = [Document(r.key, conversation_text(r.conversation)) for r in records]
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    position = {id(d): k for k, d in enumerate(docs)}
    train = [records[position[id(d)]] for d in train_docs]
    val = [records[position[id(d)]] for d in val_docs]
    logger.info(
        "read %s llava samples from %s file(s) in %.1f s",
        fmt_int(len(records)),
        fmt_int(len(files)),
        time.perf_counter() - t0,
    )
    files_key = file_fingerprint(files)

    def fingerprint(rs: Sequence) -> str:
        return "llava " + hashlib.sha256("\n".join(r.key for r in rs).encode()).hexdigest()

    return {
        "train": [r.conversation for r in train],
        "val": [r.conversation for r in val],
        "train_images": LlavaImages(train, image_size),
        "val_images": LlavaImages(val, image_size),
        "tokenizer_convs": [r.conversation for r in train],
        "key": {
            "source": "llava",
            "files": files_key,
            "val_fraction": float(cfg.val_fraction),
        },
        "fingerprint": {"train": fingerprint(train), "val": fingerprint(val)},
    }


def _task_table(ds: MultimodalDataset) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for c in ds.conversations:
        t = table.setdefault(c.task, {"n": 0, "chance": c.chance})
        t["n"] += 1
    return dict(sorted(table.items()))


def build_multimodal_data(
    data_cfg: Any,
    *,
    vocab_size: int,
    image_size: int,
    image_token_id: int,
    tokens_per_image: int,
) -> MultimodalData:
    """The tokenizer and the train/val datasets of `data_cfg.source` ('scenes' or 'llava').

    The model's numbers decide the layout: `vocab_size` bounds the tokenizer, `<image>` is
    `image_token_id`, each image takes `tokens_per_image` positions and is `image_size`
    pixels square. Every sample must fit `data_cfg.seq_len` (a DataError names one that does
    not). The config is duck-typed: any object with the `DataConfig` attributes works.
    """
    cfg = data_cfg
    if cfg.source not in SOURCES:
        raise DataError(
            f"data.source {cfg.source!r} is not an image-text source; allowed: {', '.join(SOURCES)}"
        )
    if not 0 <= image_token_id < vocab_size:
        raise DataError(
            f"image_token_id ({image_token_id}) must be a token id below vocab_size ({vocab_size})"
        )
    if tokens_per_image < 1 or image_size < 1:
        raise DataError(
            f"tokens_per_image ({tokens_per_image}) and image_size ({image_size}) must be >= 1"
        )
    if cfg.max_images < 1:
        raise DataError(f"data.max_images must be >= 1, got {cfg.max_images}")
    if cfg.source == "scenes" and cfg.scene_samples < 1:
        raise DataError(f"data.scene_samples must be >= 1, got {cfg.scene_samples}")
    t_start = time.perf_counter()
    parts = (
        _build_scenes(cfg, image_size) if cfg.source == "scenes" else _build_llava(cfg, image_size)
    )

    t0 = time.perf_counter()
    tok, tok_where = _tokenizer(
        cfg, parts["tokenizer_convs"], parts["key"], vocab_size, image_token_id
    )
    t_tok = time.perf_counter() - t0
    common = dict(
        image_token_id=image_token_id,
        tokens_per_image=tokens_per_image,
        max_images=int(cfg.max_images),
        image_size=image_size,
        seq_len=int(cfg.seq_len),
    )
    splits = {}
    for name in ("train", "val"):
        ds = MultimodalDataset(
            name,
            parts[name],
            parts[f"{name}_images"],
            tok,
            fingerprint=parts["fingerprint"][name],
            **common,
        )
        ds.check_fits(cfg.seq_len)
        splits[name] = ds
    train, val = splits["train"], splits["val"]
    val_chance = sum(c.chance for c in val.conversations) / len(val)
    info = {
        "source": cfg.source,
        "train_samples": len(train),
        "val_samples": len(val),
        "train_images": sum(c.n_images for c in train.conversations),
        "val_images": sum(c.n_images for c in val.conversations),
        "tokens_per_image": tokens_per_image,
        "max_images": int(cfg.max_images),
        "image_size": image_size,
        "image_token_id": image_token_id,
        "max_sample_tokens": max(train.max_length, val.max_length),
        "seq_len": int(cfg.seq_len),
        "tokenizer": tok_where if cfg.tokenizer else f"built-in byte-level BPE ({tok_where})",
        "vocab_size": tok.vocab_size,
        "template": "USER: <image>\\n{question} ASSISTANT: {answer}<eos>",
        "chance": val_chance,
        "val_tasks": _task_table(val),
        "tokenizer_seconds": round(t_tok, 3),
        "build_seconds": round(time.perf_counter() - t_start, 3),
    }
    logger.info(
        "%s data: %s train / %s val samples, longest %d of seq_len %d tokens, val chance %.3f",
        cfg.source,
        fmt_int(len(train)),
        fmt_int(len(val)),
        info["max_sample_tokens"],
        cfg.seq_len,
        val_chance,
    )
    return MultimodalData(tok, train, val, info)


__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "IGNORE_INDEX",
    "IMAGE_MARKER",
    "SOURCES",
    "Conversation",
    "EvalItem",
    "MultimodalData",
    "MultimodalDataset",
    "MultimodalLoader",
    "MultimodalSample",
    "build_multimodal_data",
    "eval_prompts",
    "multimodal_val_batches",
    "score_answers",
    "with_image_token",
]
