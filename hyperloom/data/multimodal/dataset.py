"""Multimodal samples as model rows: tokens with image placeholders, answer-only labels, images.

A sample is a `Conversation`: (human, gpt) turns, the human turns holding one ``<image>``
marker per image, in the LLaVA-1.5 template

    USER: <image>\\n{question} ASSISTANT: {answer}<eos>USER: {question} ASSISTANT: {answer}<eos>

Each piece is tokenized on its own (the text around each marker, then " {answer}"), so the
boundary between prompt and answer is exact and an eval prompt is a prefix of the training row.
Each marker becomes `tokens_per_image` copies of `image_token_id` (the model puts the image's
projected patches there). Only answers are learnt: `labels[i]` is the token at i + 1 where
that token belongs to an answer (its eos included), and -100 everywhere else: prompts,
images, padding. A row is padded with eos to seq_len; a sample longer than seq_len is an
error, never silently cut, since cutting would drop the very answer it is there to teach.

Text is tokenized once, when a dataset is built (it is small, and a too-long sample should
fail before training, naming the sample); images are drawn or read from disk only when a
batch asks for them. Images are normalized with the CLIP mean and std into (max_images, 3, H,
W) float32, a row's k images in its first k slots in text order, the rest zeros.

`MultimodalLoader` is `ResumableLoader` (same seeded per-epoch order, same state dict, same
refusal of a state from another dataset or seed) yielding `(ImageTokens, labels)`: a resumed
run continues bit-for-bit. `eval_prompts` and `score_answers` measure held-out answer accuracy
against each task's chance, the number a vision-language run is judged by.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hyperloom.data.errors import DataError, fmt_int
from hyperloom.data.loader import ResumableLoader
from hyperloom.data.tokenizer import Tokenizer
from hyperloom.models.vlm.inputs import ImageTokens

logger = logging.getLogger("hyperloom.data")

IMAGE_MARKER = "<image>"
IGNORE_INDEX = -100  # labels the loss skips
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MEAN = torch.tensor(CLIP_MEAN, dtype=torch.float32).view(3, 1, 1)
_STD = torch.tensor(CLIP_STD, dtype=torch.float32).view(3, 1, 1)

ImageLoader = Callable[[int], Sequence[np.ndarray]]  # sample index -> its images, (S, S, 3) uint8


@dataclass(frozen=True)
class Conversation:
    """One sample's text: (human, gpt) turns; `where` names it in error messages."""

    turns: tuple[tuple[str, str], ...]
    task: str = "chat"
    chance: float = 0.0  # accuracy of a blind guess at the first answer
    where: str = "a sample"

    @property
    def n_images(self) -> int:
        return sum(human.count(IMAGE_MARKER) for human, _ in self.turns)

    @property
    def answer(self) -> str:
        """The first answer: what `eval_prompts` asks for."""
        return self.turns[0][1]


def user_text(human: str) -> str:
    """A human turn in the template, up to and including 'ASSISTANT:'."""
    return f"USER: {human} ASSISTANT:"


def answer_text(gpt: str) -> str:
    """An answer as it follows 'ASSISTANT:' (the eos after it is a token, not text)."""
    return f" {gpt}"


def conversation_text(conv: Conversation) -> str:
    """The conversation as plain text without image markers: what a tokenizer is trained on."""
    return "\n".join(
        (user_text(h) + answer_text(g)).replace(IMAGE_MARKER, "") for h, g in conv.turns
    )


@dataclass(frozen=True)
class _Encoded:
    """A tokenized conversation, one placeholder per image (expanded when a row is made)."""

    ids: np.ndarray  # (n,) int64
    image: np.ndarray  # (n,) bool: an image placeholder
    answer: np.ndarray  # (n,) bool: an answer token (eos included)
    prompt_len: int  # compact tokens of the first turn's prompt, up to 'ASSISTANT:'


def encode_conversations(
    tok: Tokenizer, convs: Sequence[Conversation], image_token_id: int
) -> list[_Encoded]:
    """Tokenize many conversations, each distinct text piece once (templates repeat a lot)."""
    pieces: dict[str, list[int]] = {}
    for conv in convs:
        for human, gpt in conv.turns:
            for part in user_text(human).split(IMAGE_MARKER):
                pieces.setdefault(part, [])
            pieces.setdefault(answer_text(gpt), [])
    texts = list(pieces)
    for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
        pieces[text] = ids

    out = []
    for conv in convs:
        ids: list[int] = []
        image: list[bool] = []
        answer: list[bool] = []
        prompt_len = 0
        for turn, (human, gpt) in enumerate(conv.turns):
            for k, part in enumerate(user_text(human).split(IMAGE_MARKER)):
                if k:
                    ids.append(image_token_id)
                    image.append(True)
                    answer.append(False)
                ids += pieces[part]
                image += [False] * len(pieces[part])
                answer += [False] * len(pieces[part])
            if turn == 0:
                prompt_len = len(ids)
            reply = [*pieces[answer_text(gpt)], tok.eos_id]
            ids += reply
            image += [False] * len(reply)
            answer += [True] * len(reply)
        out.append(
            _Encoded(
                np.asarray(ids, dtype=np.int64),
                np.asarray(image, dtype=bool),
                np.asarray(answer, dtype=bool),
                prompt_len,
            )
        )
    return out


def normalize_images(images: Sequence[np.ndarray], max_images: int, size: int) -> torch.Tensor:
    """uint8 (S, S, 3) pictures -> (max_images, 3, S, S) float32, CLIP-normalized, zero-padded."""
    out = torch.zeros(max_images, 3, size, size, dtype=torch.float32)
    if images:
        pixels = torch.from_numpy(np.stack(images))  # (k, S, S, 3) uint8
        x = pixels.permute(0, 3, 1, 2).to(torch.float32) / 255.0  # (k, 3, S, S)
        out[: len(images)] = (x - _MEAN) / _STD
    return out


@dataclass
class MultimodalSample:
    """One row: tokens and labels (seq_len,) int64; images (max_images, 3, S, S) float32."""

    tokens: torch.Tensor
    labels: torch.Tensor
    images: torch.Tensor
    n_images: int


class MultimodalDataset:
    """Conversations with their images: `get(i)` is one padded row, `batch(idx)` a batch."""

    def __init__(
        self,
        name: str,
        conversations: Sequence[Conversation],
        load_images: ImageLoader,
        tokenizer: Tokenizer,
        *,
        image_token_id: int,
        tokens_per_image: int,
        max_images: int,
        image_size: int,
        seq_len: int,
        fingerprint: str,
    ) -> None:
        if not conversations:
            raise DataError(f"the {name} split has no samples")
        if tokens_per_image < 1:
            raise DataError(f"tokens_per_image must be >= 1, got {tokens_per_image}")
        for conv in conversations:
            if conv.n_images > max_images:
                raise DataError(
                    f"{conv.where}: {conv.n_images} images but data.max_images is {max_images}; "
                    "raise data.max_images or drop the sample"
                )
        self.name = name
        self.conversations = list(conversations)
        self.load_images = load_images
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.max_images = max_images
        self.image_size = image_size
        self.seq_len = seq_len
        self.pad_id = tokenizer.eos_id
        # A stable name for what the loader's order indexes: which samples, in which order.
        self.fingerprint = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        self._encoded = encode_conversations(tokenizer, self.conversations, image_token_id)
        n_images = np.array([int(e.image.sum()) for e in self._encoded], dtype=np.int64)
        self.lengths = np.array([len(e.ids) for e in self._encoded]) + n_images * (
            tokens_per_image - 1
        )  # (n,) tokens of each row once its images are expanded

    def __len__(self) -> int:
        """Number of samples."""
        return len(self._encoded)

    @property
    def max_length(self) -> int:
        return int(self.lengths.max())

    def check_fits(self, seq_len: int) -> None:
        """Every sample must fit one row; a DataError names the first that does not."""
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        too_long = np.flatnonzero(self.lengths > seq_len)
        if too_long.size == 0:
            return
        i = int(too_long[0])
        conv = self.conversations[i]
        images = conv.n_images
        text = int(self.lengths[i]) - images * self.tokens_per_image
        raise DataError(
            f"{conv.where}: the sample takes {fmt_int(int(self.lengths[i]))} tokens ("
            f"{fmt_int(text)} text + {images} image(s) x {self.tokens_per_image}) but "
            f"data.seq_len is {fmt_int(seq_len)}; {fmt_int(too_long.size)} of "
            f"{fmt_int(len(self))} {self.name} samples are too long, the longest takes "
            f"{fmt_int(self.max_length)}. Raise data.seq_len to at least "
            f"{fmt_int(self.max_length)}, or shorten or drop those samples."
        )

    def num_sequences(self, seq_len: int) -> int:
        """Rows per epoch (one per sample): `ResumableLoader`'s view of a dataset."""
        self.check_fits(seq_len)
        return len(self)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample i's token ids with images expanded, and its answer mask, each (length,)."""
        e = self._encoded[i]
        repeat = np.where(e.image, self.tokens_per_image, 1)
        return np.repeat(e.ids, repeat), np.repeat(e.answer, repeat)

    def images(self, i: int) -> torch.Tensor:
        """Sample i's images, (max_images, 3, S, S) float32 (drawn or read now)."""
        pictures = list(self.load_images(i)) if self.conversations[i].n_images else []
        if len(pictures) != self.conversations[i].n_images:
            raise AssertionError(f"{self.conversations[i].where}: image loader count mismatch")
        for p in pictures:
            if p.shape != (self.image_size, self.image_size, 3) or p.dtype != np.uint8:
                raise AssertionError(f"image loader returned {p.shape} {p.dtype}")
        return normalize_images(pictures, self.max_images, self.image_size)

    def row(self, i: int, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i's (tokens, labels), each (seq_len,) int64, without loading its images."""
        seq_len = self.seq_len if seq_len is None else seq_len
        ids, answer = self.sequence(i)
        n = len(ids)
        if n > seq_len:
            self.check_fits(seq_len)
        tokens = np.full(seq_len, self.pad_id, dtype=np.int64)
        tokens[:n] = ids
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[: n - 1] = np.where(answer[1:], ids[1:], IGNORE_INDEX)  # next token, if an answer
        return torch.from_numpy(tokens), torch.from_numpy(labels)

    def get(self, i: int, seq_len: int | None = None) -> MultimodalSample:
        """Sample i as one padded row (seq_len defaults to the data.seq_len it was built for)."""
        tokens, labels = self.row(i, seq_len)
        return MultimodalSample(tokens, labels, self.images(i), self.conversations[i].n_images)

    def batch(
        self, indices: Sequence[int] | np.ndarray, seq_len: int | None = None
    ) -> tuple[ImageTokens, torch.Tensor]:
        """(ImageTokens(tokens, images), labels): tokens and labels (batch, seq_len) int64,
        images (batch, max_images, 3, S, S) float32."""
        rows = [self.get(int(i), seq_len) for i in indices]
        tokens = torch.stack([r.tokens for r in rows])
        images = torch.stack([r.images for r in rows])
        labels = torch.stack([r.labels for r in rows])
        return ImageTokens(tokens, images), labels

    def __repr__(self) -> str:
        return (
            f"MultimodalDataset({self.name!r}, samples={len(self):,}, "
            f"max_length={self.max_length}, max_images={self.max_images})"
        )


class MultimodalLoader(ResumableLoader):
    """Endless (ImageTokens, labels) batches in a seeded per-epoch order, resumable exactly.

    The order, the state dict and its checks are `ResumableLoader`'s, one row per sample; the
    state also records the dataset's fingerprint, and a state from another dataset is refused.
    """

    def __init__(
        self,
        dataset: MultimodalDataset,
        batch_size: int,
        seq_len: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        super().__init__(dataset, batch_size, seq_len, seed, shuffle)  # type: ignore[arg-type]
        self.dataset: MultimodalDataset = dataset

    def next_batch(self) -> tuple[ImageTokens, torch.Tensor]:  # type: ignore[override]
        """The next (ImageTokens, labels); see `MultimodalDataset.batch` for the shapes."""
        return self.dataset.batch(self._next_indices(), self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dataset": self.dataset.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`ResumableLoader.load_state_dict`, and the dataset fingerprint must match."""
        before = self.epoch, self.index
        super().load_state_dict(state)
        saved = state.get("dataset")
        if saved is not None and saved != self.dataset.fingerprint:
            self.epoch, self.index = before
            raise DataError(
                f"loader state does not match this loader: it was saved on dataset {saved!r}, "
                f"this loader reads {self.dataset.fingerprint!r} ({self.dataset.name!r}: "
                f"{fmt_int(len(self.dataset))} samples). Resume with the same data config, "
                "or start afresh."
            )


def multimodal_val_batches(
    dataset: MultimodalDataset, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[ImageTokens, torch.Tensor]]:
    """The first `n_batches` full batches in order (fewer if the split is small): the same
    fixed batches every evaluation, so losses compare across steps and runs."""
    if batch_size < 1 or n_batches < 1:
        raise DataError(f"batch_size and n_batches must be >= 1, got {batch_size}, {n_batches}")
    dataset.check_fits(seq_len)
    available = len(dataset) // batch_size
    if available == 0:
        raise DataError(
            f"the {dataset.name} split has {fmt_int(len(dataset))} samples; one batch needs "
            f"batch_size = {batch_size}. Raise data.val_fraction (or data.scene_samples) or "
            "lower the batch size."
        )
    if available < n_batches:
        logger.warning(
            "%s split fills only %d of the %d requested batches", dataset.name, available, n_batches
        )
    return [
        dataset.batch(np.arange(b * batch_size, (b + 1) * batch_size), seq_len)
        for b in range(min(n_batches, available))
    ]


@dataclass
class EvalItem:
    """A held-out question: the prompt to continue, and what a correct answer is."""

    prompt: torch.Tensor  # (prompt_len,) int64: up to and including 'ASSISTANT:', images expanded
    images: torch.Tensor  # (max_images, 3, S, S) float32
    n_images: int
    answer: str
    task: str
    chance: float


def _prompt(e: _Encoded, tokens_per_image: int) -> np.ndarray:
    """The first turn's prompt, up to and including 'ASSISTANT:', images expanded."""
    compact = e.ids[: e.prompt_len]
    return np.repeat(compact, np.where(e.image[: e.prompt_len], tokens_per_image, 1))


def encode_prompt(
    tok: Tokenizer, question: str, image_token_id: int, tokens_per_image: int
) -> list[int]:
    """Token ids of one user turn asking `question` (its `<image>` markers expanded to
    placeholders), tokenized exactly as a training row's prompt is."""
    (e,) = encode_conversations(tok, [Conversation(((question, ""),))], image_token_id)
    return _prompt(e, tokens_per_image).tolist()


def eval_item(dataset: MultimodalDataset, i: int) -> EvalItem:
    """Sample i as a prompt for generation (its first turn) and the answer it should get."""
    conv = dataset.conversations[i]
    prompt = _prompt(dataset._encoded[i], dataset.tokens_per_image)
    return EvalItem(
        torch.from_numpy(prompt),
        dataset.images(i),
        conv.n_images,
        conv.answer,
        conv.task,
        conv.chance,
    )


def eval_prompts(dataset: MultimodalDataset, n: int) -> list[EvalItem]:
    """The first `n` samples (all if fewer) as prompts for generation; the first turn only."""
    return [eval_item(dataset, i) for i in range(min(n, len(dataset)))]


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def score_answers(items: Sequence[EvalItem], predicted: Sequence[str]) -> dict[str, Any]:
    """Exact-match accuracy (case and surrounding/repeated whitespace ignored), overall and
    by task, each beside its chance: the mean chance of the items scored."""
    if len(items) != len(predicted):
        raise ValueError(f"{len(items)} eval items but {len(predicted)} predictions")
    by_task: dict[str, dict[str, Any]] = {}
    for item, pred in zip(items, predicted, strict=True):
        t = by_task.setdefault(item.task, {"correct": 0, "chance": 0.0, "n": 0})
        t["correct"] += _norm(pred) == _norm(item.answer)
        t["chance"] += item.chance
        t["n"] += 1
    n = len(items)
    report = {
        "accuracy": sum(t["correct"] for t in by_task.values()) / n if n else 0.0,
        "chance": sum(t["chance"] for t in by_task.values()) / n if n else 0.0,
        "n": n,
        "by_task": {
            task: {"accuracy": t["correct"] / t["n"], "chance": t["chance"] / t["n"], "n": t["n"]}
            for task, t in sorted(by_task.items())
        },
    }
    return report
