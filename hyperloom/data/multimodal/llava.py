"""User image-text data in the LLaVA JSONL format, its images read with Pillow.

One JSON object a line, as LLaVA's instruction-tuning sets are written:

    {"id": "0001", "image": "cats/a.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWhat is on the mat?"},
                       {"from": "gpt", "value": "A cat."}, ...]}

`image` is optional (a text-only sample), a path or a list of paths, relative to
`data.image_root` (the JSONL file's folder if that is empty). Turns alternate human, gpt,
human, ..., ending with gpt; every gpt turn is an answer the model learns. Each image has
exactly one `<image>` marker in a human turn, where its tokens go; the k-th marker is the k-th
image. Every problem a user can fix is a DataError naming the file, the line and the id:
malformed JSON, missing keys, roles out of turn, a marker count that differs from the image
count, more images than `data.max_images`, an image file that does not exist (checked when the
file is read, so a typo fails before training, not hours into it).

Images are decoded only when a batch asks for them. Each is converted to RGB, padded to a
square with the CLIP mean colour (LLaVA-1.5's "pad" aspect mode: nothing is cropped away), and
resized with bicubic filtering to the model's image size. The held-out split is decided per
line by a stable hash of (file name, line number), as `hyperloom.data.corpus` splits documents.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from hyperloom.data.corpus import SourceFile, files_under, jsonl_objects
from hyperloom.data.errors import DataError
from hyperloom.data.multimodal.dataset import CLIP_MEAN, IMAGE_MARKER, Conversation

HUMAN, GPT = "human", "gpt"


@dataclass(frozen=True)
class LlavaRecord:
    """One JSONL line: its conversation, its image files (in marker order), a stable id."""

    conversation: Conversation
    images: tuple[Path, ...]
    key: str  # "<file name>#<line>": what the train/val split hashes


def resolve_llava_files(cfg: Any) -> list[SourceFile]:
    """The *.jsonl files data.paths names (files, or directories searched recursively)."""
    return files_under(cfg.paths, ".jsonl", "llava")


def _image_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise DataError(
        f"{where}: field 'image' is a {type(value).__name__}; expected a path string or a list "
        "of path strings"
    )


def _turns(record: dict, where: str) -> tuple[tuple[str, str], ...]:
    convs = record.get("conversations")
    if convs is None:
        keys = ", ".join(sorted(record)) or "none"
        raise DataError(f"{where} lacks field 'conversations' (fields present: {keys})")
    if not isinstance(convs, list) or not convs:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of turns")
    values: list[str] = []
    for k, turn in enumerate(convs, start=1):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DataError(
                f"{where}: turn {k} of 'conversations' must be an object with 'from' and "
                f"'value', got {json.dumps(turn)[:80]}"
            )
        expected = HUMAN if k % 2 else GPT
        if turn["from"] != expected:
            raise DataError(
                f"{where}: turn {k} is from {turn['from']!r} but {expected!r} was expected; "
                f"roles must alternate {HUMAN!r}, {GPT!r}, {HUMAN!r}, ... starting with "
                f"{HUMAN!r}"
            )
        if not isinstance(turn["value"], str):
            raise DataError(
                f"{where}: turn {k}'s 'value' is a {type(turn['value']).__name__}, expected a "
                "string"
            )
        values.append(turn["value"])
    if len(values) % 2:
        raise DataError(
            f"{where}: the conversation ends with a {HUMAN!r} turn that has no {GPT!r} answer; "
            "every human turn needs one"
        )
    for k, gpt in enumerate(values[1::2], start=1):
        if IMAGE_MARKER in gpt:
            raise DataError(
                f"{where}: gpt turn {k} contains {IMAGE_MARKER!r}; image markers belong in the "
                "human turns"
            )
    return tuple(zip(values[0::2], values[1::2], strict=True))


def _image_root(cfg: Any, jsonl: Path) -> tuple[Path, str]:
    if cfg.image_root:
        return Path(cfg.image_root).expanduser(), f"data.image_root = {cfg.image_root!r}"
    return jsonl.parent, "the JSONL file's folder, as data.image_root is empty"


def read_llava_file(cfg: Any, f: SourceFile, max_images: int) -> list[LlavaRecord]:
    """Parse and check one JSONL file; image files must exist (they are not read yet)."""
    root, root_doc = _image_root(cfg, f.path)
    try:
        return [_record(root, root_doc, f, *line, max_images) for line in jsonl_objects(f.path)]
    except OSError as exc:
        raise DataError(f"cannot read data file {str(f.path)!r}: {exc.strerror or exc}") from None


def _record(
    root: Path,
    root_doc: str,
    f: SourceFile,
    line_no: int,
    where: str,
    record: dict,
    max_images: int,
) -> LlavaRecord:
    """One JSONL object as a checked sample (its image files must exist)."""
    if "id" in record:
        where += f" (id {record['id']!r})"
    turns = _turns(record, where)
    names = _image_list(record.get("image"), where)
    markers = sum(h.count(IMAGE_MARKER) for h, _ in turns)
    if markers != len(names):
        raise DataError(
            f"{where}: {markers} {IMAGE_MARKER} marker(s) in the human turns but "
            f"{len(names)} image(s) in 'image'; each image needs exactly one marker where "
            "it belongs in the text"
        )
    if len(names) > max_images:
        raise DataError(
            f"{where}: {len(names)} images but data.max_images is {max_images}; raise "
            "data.max_images or drop the sample"
        )
    paths = []
    for name in names:
        path = root / name
        if not path.is_file():
            raise DataError(
                f"{where}: image file {str(path)!r} does not exist (image paths are "
                f"relative to {root_doc})"
            )
        paths.append(path)
    conv = Conversation(turns, task="llava", chance=0.0, where=where)
    return LlavaRecord(conv, tuple(paths), f"{f.name}#{line_no}")


def read_llava(cfg: Any, files: Sequence[SourceFile], max_images: int) -> list[LlavaRecord]:
    """Every sample of the configured JSONL files, in file order."""
    records = [r for f in files for r in read_llava_file(cfg, f, max_images)]
    if not records:
        names = ", ".join(repr(str(f.path)) for f in files[:3]) + (
            ", ..." if len(files) > 3 else ""
        )
        raise DataError(f"the 'llava' data is empty: no samples found in {names}")
    return records


def pad_to_square(img: Image.Image) -> Image.Image:
    """Pad the short side equally with the CLIP mean colour (LLaVA-1.5's expand2square)."""
    w, h = img.size
    if w == h:
        return img
    fill = tuple(int(m * 255) for m in CLIP_MEAN)
    side = max(w, h)
    out = Image.new("RGB", (side, side), fill)
    out.paste(img, ((side - w) // 2, (side - h) // 2))
    return out


def load_image(path: Path, image_size: int, where: str = "") -> np.ndarray:
    """An image file as (image_size, image_size, 3) uint8 RGB, padded square and resized."""
    try:
        with Image.open(path) as raw:
            img = raw.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        prefix = f"{where}: " if where else ""
        raise DataError(f"{prefix}cannot read image {str(path)!r}: {reason}") from None
    img = pad_to_square(img)
    if img.size != (image_size, image_size):
        img = img.resize((image_size, image_size), Image.Resampling.BICUBIC)
    return np.asarray(img, dtype=np.uint8)


class LlavaImages:
    """Sample index -> its images, read from disk on each call (nothing is kept in memory)."""

    def __init__(self, records: Sequence[LlavaRecord], image_size: int) -> None:
        self.records = list(records)
        self.image_size = image_size

    def __call__(self, i: int) -> list[np.ndarray]:
        r = self.records[i]
        return [load_image(p, self.image_size, r.conversation.where) for p in r.images]
