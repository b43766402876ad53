"""Scenes: a built-in, deterministic, download-free image-text set for vision-language models.

A vision-language model needs images paired with questions whose answers can only come from
looking, and a held-out split on which "accuracy X vs chance Y" means something. This module
draws them: small RGB pictures of 1-4 shapes (square, circle, triangle) in distinct colours,
one per cell of a 2x2 grid on a grey background, with a little jitter of size and position;
or a short word or number written in a built-in 3x5 bitmap font. Each sample asks one thing:

    count          "How many shapes are there?"           -> "3"          chance 1/4
    colour         "What colour is the circle?"           -> "red"        chance 1/6
    position       "Where is the blue square?"            -> "top left"   chance 1/4
    caption        "Describe the image." (1-2 shapes)     -> "a red circle at top left and ..."
    read           "Read the text."                       -> "fish" / "4071"
    compare        two images: "Which image has more shapes?" -> "first" / "second" (never tied)
    arithmetic     no image: "What is 2 plus 3?"          -> "5"          chance 1/19

(caption and read have no meaningful chance: 0). The colour question is asked only about a
shape kind that occurs once in the picture, so every question has exactly one answer.

Determinism. Sample i of a split is a pure function of (the split's seed, i): its random draws
come from SplitMix64 on Python integers, seeded by SHA-256 of (seed, i, attempt), so they are
the same on every machine and for every numpy version; nothing is cached, and an image is drawn
only when asked for. A sample is first drawn as a `SceneSample` of discrete choices (kinds,
colours, cells, jitter *levels*), independent of the image size; `render` maps the levels to
pixels with integer geometry, so distinct samples give distinct pixels at any size >=
`MIN_IMAGE_SIZE`, and the pixels are the same everywhere (no anti-aliasing, no fonts).

Held-out split. Train and val use different seeds, and, so that no val sample equals a train
sample, the space of samples is partitioned by a stable hash of the sample's full description
(`SceneSample.key`): val keeps only draws whose hash falls below `VAL_SHARE`, train only the
others (a rejected draw is redrawn with the next attempt number). So val measures the same
distribution as train without a single exact repeat of a training sample.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from hyperloom.data.corpus import stable_unit
from hyperloom.data.errors import DataError

GENERATOR_VERSION = 2  # bump when any draw or rendering changes: it keys the tokenizer cache
MIN_IMAGE_SIZE = 24  # below this the jittered shapes no longer fit their cells
VAL_SHARE = 0.125  # share of the sample space reserved for the held-out split

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 190, 70),
    "blue": (50, 100, 245),
    "yellow": (240, 215, 40),
    "white": (235, 235, 235),
    "purple": (165, 70, 225),
}
COLOURS = tuple(PALETTE)
KINDS = ("square", "circle", "triangle")
CELLS = ("top left", "top right", "bottom left", "bottom right")  # row-major 2x2 grid
MAX_SHAPES = 4
CAPTION_MAX_SHAPES = 2  # a caption of 4 shapes is ~110 byte-level tokens: too long for small rows
WORDS = (
    "cat", "dog", "sun", "box", "map", "cup", "key", "fox", "owl", "bee", "hat", "pen",
    "jam", "web", "zip", "van", "yak", "quiz", "tree", "fish", "bird", "star", "moon",
    "boat", "lamp", "ship", "frog", "leaf", "door", "milk", "rain", "snow", "wind", "gold",
    "king", "jump", "view", "apple", "house", "river", "cloud", "stone", "light", "train",
    "plant", "bread", "chair", "mouse", "queen", "zebra", "piano", "lemon", "tiger", "water",
)  # fmt: skip

# The 3x5 bitmap font: five rows of three columns, "#" = ink. Defined here so every machine
# renders identical pixels.
GLYPHS: dict[str, tuple[str, ...]] = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", ".##", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
    "a": (".#.", "#.#", "###", "#.#", "#.#"),
    "b": ("##.", "#.#", "##.", "#.#", "##."),
    "c": (".##", "#..", "#..", "#..", ".##"),
    "d": ("##.", "#.#", "#.#", "#.#", "##."),
    "e": ("###", "#..", "##.", "#..", "###"),
    "f": ("###", "#..", "##.", "#..", "#.."),
    "g": (".##", "#..", "#.#", "#.#", ".##"),
    "h": ("#.#", "#.#", "###", "#.#", "#.#"),
    "i": ("###", ".#.", ".#.", ".#.", "###"),
    "j": ("..#", "..#", "..#", "#.#", ".#."),
    "k": ("#.#", "#.#", "##.", "#.#", "#.#"),
    "l": ("#..", "#..", "#..", "#..", "###"),
    "m": ("#.#", "###", "###", "#.#", "#.#"),
    "n": ("##.", "#.#", "#.#", "#.#", "#.#"),
    "o": (".#.", "#.#", "#.#", "#.#", ".#."),
    "p": ("##.", "#.#", "##.", "#..", "#.."),
    "q": (".#.", "#.#", "#.#", "##.", ".##"),
    "r": ("##.", "#.#", "##.", "#.#", "#.#"),
    "s": (".##", "#..", ".#.", "..#", "##."),
    "t": ("###", ".#.", ".#.", ".#.", ".#."),
    "u": ("#.#", "#.#", "#.#", "#.#", "###"),
    "v": ("#.#", "#.#", "#.#", "#.#", ".#."),
    "w": ("#.#", "#.#", "###", "###", "#.#"),
    "x": ("#.#", "#.#", ".#.", "#.#", "#.#"),
    "y": ("#.#", "#.#", ".#.", ".#.", ".#."),
    "z": ("###", "..#", ".#.", "#..", "###"),
}
GLYPH_W, GLYPH_H = 3, 5

ARITHMETIC_MAX = 9  # operands of the text-only task: 0..9, so sums 0..18


@dataclass(frozen=True)
class Task:
    """A question type: how often it is drawn (of `sum(weights)`), its chance accuracy."""

    name: str
    weight: int
    chance: float
    images: int  # images per sample


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("count", 18, 1 / MAX_SHAPES, 1),
        Task("colour", 18, 1 / len(COLOURS), 1),
        Task("position", 18, 1 / len(CELLS), 1),
        Task("caption", 15, 0.0, 1),
        Task("read", 16, 0.0, 1),
        Task("compare", 10, 1 / 2, 2),
        Task("arithmetic", 5, 1 / (2 * ARITHMETIC_MAX + 1), 0),
    )
}


class SceneRng:
    """SplitMix64 on Python integers: identical draws on every machine, numpy version, OS."""

    _MASK = (1 << 64) - 1

    def __init__(self, *key: int | str) -> None:
        digest = hashlib.sha256(repr(key).encode()).digest()
        self.state = int.from_bytes(digest[:8], "big")

    def next64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self._MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """An integer in [0, n) (the modulo bias of 64-bit draws is below 1e-17 here)."""
        return self.next64() % n

    def pick(self, seq):
        return seq[self.below(len(seq))]

    def sample(self, seq, k: int) -> list:
        """k distinct elements in random order (a partial Fisher-Yates shuffle)."""
        pool = list(seq)
        for i in range(k):
            j = i + self.below(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]


@dataclass(frozen=True)
class Shape:
    """One shape: its kind, colour and grid cell (index into CELLS); size and offset levels."""

    kind: str
    colour: str
    cell: int
    size: int  # 0..2
    dx: int  # -1..1
    dy: int  # -1..1


@dataclass(frozen=True)
class Scene:
    """A picture of shapes, sorted by cell; background levels 0..7 per channel."""

    shapes: tuple[Shape, ...]
    background: tuple[int, int, int]


@dataclass(frozen=True)
class TextPanel:
    """A picture of a short lowercase word or a number in the 3x5 font."""

    text: str
    colour: str
    dx: int  # -1..1
    dy: int  # -1..1
    background: tuple[int, int, int]


Picture = Scene | TextPanel


@dataclass(frozen=True)
class SceneSample:
    """One sample: its task, question, answer and pictures (0, 1 or 2), all size-independent."""

    task: str
    question: str
    answer: str
    pictures: tuple[Picture, ...]

    @property
    def chance(self) -> float:
        return TASKS[self.task].chance

    def key(self) -> str:
        """Everything that determines the sample's pixels and text, as one canonical string."""
        return f"v{GENERATOR_VERSION}|{self.task}|{self.question}|{self.pictures!r}"

    def images(self, image_size: int) -> list[np.ndarray]:
        """The pictures rendered, each (image_size, image_size, 3) uint8."""
        return [render(p, image_size) for p in self.pictures]


@dataclass(frozen=True)
class SceneSplit:
    """A split of the scenes set: its seed, and which side of the hash partition it keeps."""

    name: str
    seed: int
    held_out: bool


TRAIN = SceneSplit("train", 0x5CE7E5_01, held_out=False)
VAL = SceneSplit("val", 0x5CE7E5_02, held_out=True)


# --- drawing samples --------------------------------------------------------------------------


def _background(rng: SceneRng) -> tuple[int, int, int]:
    return (rng.below(8), rng.below(8), rng.below(8))


def random_scene(rng: SceneRng, n_shapes: int) -> Scene:
    """n_shapes shapes in distinct cells and distinct colours, sorted by cell."""
    if not 1 <= n_shapes <= MAX_SHAPES:
        raise ValueError(f"a scene holds 1..{MAX_SHAPES} shapes, got {n_shapes}")
    cells = rng.sample(range(len(CELLS)), n_shapes)
    colours = rng.sample(COLOURS, n_shapes)
    shapes = [
        Shape(rng.pick(KINDS), colour, cell, rng.below(3), rng.below(3) - 1, rng.below(3) - 1)
        for cell, colour in zip(cells, colours, strict=True)
    ]
    return Scene(tuple(sorted(shapes, key=lambda s: s.cell)), _background(rng))


def caption(scene: Scene) -> str:
    """'a red circle at top left, a blue square at top right and a green triangle at ...'."""
    parts = [f"a {s.colour} {s.kind} at {CELLS[s.cell]}" for s in scene.shapes]
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _draw_task(rng: SceneRng, task: str) -> SceneSample:
    if task == "count":
        scene = random_scene(rng, 1 + rng.below(MAX_SHAPES))
        return SceneSample(task, "How many shapes are there?", str(len(scene.shapes)), (scene,))
    if task == "colour":
        while True:  # redraw until some kind occurs exactly once: the question has one answer
            scene = random_scene(rng, 1 + rng.below(MAX_SHAPES))
            kinds = [s.kind for s in scene.shapes]
            unique = [s for s in scene.shapes if kinds.count(s.kind) == 1]
            if unique:
                break
        shape = rng.pick(unique)
        return SceneSample(task, f"What colour is the {shape.kind}?", shape.colour, (scene,))
    if task == "position":
        scene = random_scene(rng, 1 + rng.below(MAX_SHAPES))
        shape = rng.pick(scene.shapes)
        question = f"Where is the {shape.colour} {shape.kind}?"
        return SceneSample(task, question, CELLS[shape.cell], (scene,))
    if task == "caption":
        scene = random_scene(rng, 1 + rng.below(CAPTION_MAX_SHAPES))
        return SceneSample(task, "Describe the image.", caption(scene), (scene,))
    if task == "read":
        if rng.below(2):
            text = rng.pick(WORDS)
        else:
            digits = 3 + rng.below(2)
            text = str(10 ** (digits - 1) + rng.below(9 * 10 ** (digits - 1)))
        colour = rng.pick(COLOURS)
        panel = TextPanel(text, colour, rng.below(3) - 1, rng.below(3) - 1, _background(rng))
        return SceneSample(task, "Read the text.", text, (panel,))
    if task == "compare":
        n1, n2 = (1 + c for c in rng.sample(range(MAX_SHAPES), 2))
        pictures = (random_scene(rng, n1), random_scene(rng, n2))
        answer = "first" if n1 > n2 else "second"
        return SceneSample(task, "Which image has more shapes?", answer, pictures)
    if task == "arithmetic":
        a, b = rng.below(ARITHMETIC_MAX + 1), rng.below(ARITHMETIC_MAX + 1)
        return SceneSample(task, f"What is {a} plus {b}?", str(a + b), ())
    raise ValueError(f"unknown scenes task {task!r}; known: {', '.join(TASKS)}")


def _pick_task(rng: SceneRng, tasks: tuple[Task, ...]) -> str:
    u = rng.below(sum(t.weight for t in tasks))
    for t in tasks:
        if u < t.weight:
            return t.name
        u -= t.weight
    raise AssertionError("unreachable")


def task_table(max_images: int) -> tuple[Task, ...]:
    """The tasks a split draws: those whose images fit `max_images` slots."""
    return tuple(t for t in TASKS.values() if t.images <= max_images)


def scene_sample(
    split: SceneSplit, index: int, max_images: int = 2, *, _tasks: tuple[Task, ...] | None = None
) -> SceneSample:
    """Sample `index` of `split`: a pure function of (split.seed, index, max_images).

    Draws are redrawn (attempt 1, 2, ...) until the sample's key hashes onto the split's side
    of the train/val partition, so the two splits never share a sample.
    """
    tasks = _tasks or task_table(max_images)
    attempt = 0
    while True:
        rng = SceneRng(split.seed, index, attempt)
        sample = _draw_task(rng, _pick_task(rng, tasks))
        if (stable_unit(sample.key(), "scenes-split") < VAL_SHARE) == split.held_out:
            return sample
        attempt += 1


def scene_samples(split: SceneSplit, n: int, max_images: int = 2) -> list[SceneSample]:
    """Samples 0..n-1 of `split` (text and drawing instructions only: no pixels yet)."""
    tasks = task_table(max_images)
    return [scene_sample(split, i, max_images, _tasks=tasks) for i in range(n)]


# --- rendering --------------------------------------------------------------------------------


def check_image_size(image_size: int) -> None:
    if image_size < MIN_IMAGE_SIZE:
        raise DataError(
            f"the scenes source draws images of at least {MIN_IMAGE_SIZE} x {MIN_IMAGE_SIZE} "
            f"pixels (four jittered shapes must fit a 2x2 grid); the model's image_size is "
            f"{image_size}. Raise model.image_size, or use data.source = 'llava'."
        )


def _canvas(image_size: int, background: tuple[int, int, int]) -> np.ndarray:
    img = np.empty((image_size, image_size, 3), dtype=np.uint8)
    # Mid grey, 100..135 per channel, near the CLIP mean the images are normalised by: the
    # background then enters the model near zero. On a dark one (-1.6 after normalisation)
    # every flat patch added the same input to the patch embedding's gradient, which spiked to
    # 10-60x the rest's norm once the model began to read the images.
    img[:] = [100 + 5 * level for level in background]
    return img


def _shape_mask(shape: Shape, image_size: int) -> np.ndarray:
    """Which pixels the shape covers; exact arithmetic on pixel centres (halves, squares)."""
    cell = image_size // 2
    step = max(1, cell // 16)  # pixels per jitter level: distinct levels, distinct pixels
    r = cell // 4 + shape.size * step  # half-extent; fits: cell/2 + step + r <= cell
    row, col = divmod(shape.cell, 2)
    cx = col * cell + cell / 2 + shape.dx * step
    cy = row * cell + cell / 2 + shape.dy * step
    y = np.arange(image_size, dtype=np.float64)[:, None] + 0.5 - cy  # (S, 1)
    x = np.arange(image_size, dtype=np.float64)[None, :] + 0.5 - cx  # (1, S)
    if shape.kind == "square":
        return (np.abs(x) <= r) & (np.abs(y) <= r)
    if shape.kind == "circle":
        return x * x + y * y <= r * r
    if shape.kind == "triangle":  # apex up: half-width grows from 0 at the top to r at the base
        return (y >= -r) & (y <= r) & (np.abs(x) <= (y + r) / 2)
    raise ValueError(f"unknown shape kind {shape.kind!r}; known: {', '.join(KINDS)}")


def text_bitmap(text: str) -> np.ndarray:
    """The text in the 3x5 font, one blank column between glyphs: (5, 4 * len - 1) bool."""
    missing = sorted({c for c in text if c not in GLYPHS})
    if missing:
        raise ValueError(f"the 3x5 font has no glyph for {missing}; it has a-z and 0-9")
    cols = []
    for k, ch in enumerate(text):
        if k:
            cols.append(np.zeros((GLYPH_H, 1), dtype=bool))
        cols.append(np.array([[c == "#" for c in row] for row in GLYPHS[ch]], dtype=bool))
    return np.concatenate(cols, axis=1)


def _render_text(panel: TextPanel, image_size: int) -> np.ndarray:
    img = _canvas(image_size, panel.background)
    bits = text_bitmap(panel.text)
    step = max(1, image_size // 32)
    scale = max(1, min((image_size - 2 * step) // bits.shape[1], image_size // (2 * GLYPH_H)))
    big = np.kron(bits, np.ones((scale, scale), dtype=bool))  # (5 * scale, width * scale)
    h, w = big.shape
    y0 = (image_size - h) // 2 + panel.dy * step
    x0 = (image_size - w) // 2 + panel.dx * step
    region = img[y0 : y0 + h, x0 : x0 + w]
    region[big] = PALETTE[panel.colour]
    return img


def render(picture: Picture, image_size: int) -> np.ndarray:
    """One picture as (image_size, image_size, 3) uint8 RGB."""
    check_image_size(image_size)
    if isinstance(picture, TextPanel):
        return _render_text(picture, image_size)
    img = _canvas(image_size, picture.background)
    for shape in picture.shapes:
        img[_shape_mask(shape, image_size)] = PALETTE[shape.colour]
    return img


def render_scene(
    seed_or_rng: int | SceneRng, image_size: int, n_shapes: int | None = None
) -> tuple[np.ndarray, Scene]:
    """A random scene (1-4 shapes unless `n_shapes`) and its pixels, (S, S, 3) uint8."""
    rng = seed_or_rng if isinstance(seed_or_rng, SceneRng) else SceneRng(seed_or_rng)
    scene = random_scene(rng, n_shapes if n_shapes is not None else 1 + rng.below(MAX_SHAPES))
    return render(scene, image_size), scene
