"""Tests for hyperloom.data.multimodal: the scenes generator, the LLaVA JSONL reader, rows and
labels, the tokenizer's <image> id, the resumable loader and answer scoring."""

from __future__ import annotations

import hashlib
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import hyperloom.data.multimodal as mm
from hyperloom.config.data import DataConfig
from hyperloom.data import DataError, Tokenizer
from hyperloom.data.multimodal import (
    IGNORE_INDEX,
    IMAGE_MARKER,
    MultimodalLoader,
    build_multimodal_data,
    eval_prompts,
    multimodal_val_batches,
    score_answers,
)
from hyperloom.data.multimodal import scenes as sc
from hyperloom.data.multimodal.dataset import CLIP_MEAN, CLIP_STD
from hyperloom.data.multimodal.llava import load_image, pad_to_square

VOCAB = 300
IMAGE_ID = VOCAB - 1
SIZE = 32
TPI = 16
SEQ = 96
EOS = "<|endoftext|>"


def make_cfg(cache: Path, **overrides) -> types.SimpleNamespace:
    cfg = dict(
        source="scenes",
        paths=[],
        text_field="text",
        tokenizer="",
        eos_token=EOS,
        seq_len=SEQ,
        val_fraction=0.02,
        max_corpus_mb=0.0,
        image_root="",
        max_images=2,
        scene_samples=600,
        cache_dir=str(cache),
    )
    cfg.update(overrides)
    return types.SimpleNamespace(**cfg)


def build(cfg, **model):
    args = dict(vocab_size=VOCAB, image_size=SIZE, image_token_id=IMAGE_ID, tokens_per_image=TPI)
    args.update(model)
    return build_multimodal_data(cfg, **args)


@pytest.fixture(scope="module")
def scenes_data(tmp_path_factory):
    return build(make_cfg(tmp_path_factory.mktemp("scenes-cache")))


# --- the generator ----------------------------------------------------------------------------


def _sample_digest(samples, size: int = SIZE) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(f"{s.task}|{s.question}|{s.answer}".encode())
        for img in s.images(size):
            h.update(img.tobytes())
    return h.hexdigest()


# Pinned: the first 8 train samples' text and pixels at 32 px. A change means every machine's
# scenes changed: bump scenes.GENERATOR_VERSION (it keys the tokenizer cache) and this digest.
PINNED_TRAIN_DIGEST = "25acedc0887ffede004de4e482ab476fe979f0da9e63fa9945d7cf46b428661d"


def test_scene_samples_are_pure_functions_of_seed_and_index():
    first = sc.scene_samples(sc.TRAIN, 8)
    again = [sc.scene_sample(sc.TRAIN, i) for i in range(8)]
    assert first == again
    assert _sample_digest(first) == _sample_digest(again) == PINNED_TRAIN_DIGEST
    assert sc.scene_samples(sc.VAL, 8) != first


def test_rng_is_fixed_integer_arithmetic():
    rng = sc.SceneRng(1, 2, 3)
    assert [rng.next64(), rng.next64()] == [11690836110512966290, 450444086482195765]
    assert sc.SceneRng(1, 2, 4).next64() != 11690836110512966290
    assert sorted(sc.SceneRng(7).sample(range(4), 4)) == [0, 1, 2, 3]


def test_every_task_is_drawn_and_answers_are_consistent():
    samples = sc.scene_samples(sc.TRAIN, 1500)
    assert {s.task for s in samples} == set(sc.TASKS)
    for s in samples:
        assert len(s.pictures) == sc.TASKS[s.task].images
        if s.task == "count":
            assert s.answer == str(len(s.pictures[0].shapes))
        elif s.task == "colour":
            kind = s.question.removeprefix("What colour is the ").removesuffix("?")
            matches = [x for x in s.pictures[0].shapes if x.kind == kind]
            assert len(matches) == 1 and matches[0].colour == s.answer
        elif s.task == "position":
            colour, kind = s.question.removeprefix("Where is the ").removesuffix("?").split()
            (shape,) = [x for x in s.pictures[0].shapes if (x.colour, x.kind) == (colour, kind)]
            assert sc.CELLS[shape.cell] == s.answer
        elif s.task == "compare":
            n1, n2 = (len(p.shapes) for p in s.pictures)
            assert n1 != n2 and s.answer == ("first" if n1 > n2 else "second")
        elif s.task == "read":
            assert s.answer == s.pictures[0].text
        elif s.task == "arithmetic":
            a, b = s.question.removeprefix("What is ").removesuffix("?").split(" plus ")
            assert s.answer == str(int(a) + int(b))


def test_shapes_are_drawn_in_their_colour_and_cell():
    img, scene = sc.render_scene(5, 64, n_shapes=4)
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8
    for shape in scene.shapes:
        row, col = divmod(shape.cell, 2)
        cell = img[row * 32 : row * 32 + 32, col * 32 : col * 32 + 32].reshape(-1, 3)
        colour_px = (cell == sc.PALETTE[shape.colour]).all(axis=1).sum()
        assert colour_px > 30, shape
    grey = (img.min(axis=2) >= 100) & (img.max(axis=2) <= 135)
    assert grey.mean() > 0.3  # a grey background, near the CLIP mean


def test_font_glyphs_are_distinct_and_text_renders():
    bitmaps = {tuple(g) for g in sc.GLYPHS.values()}
    assert len(bitmaps) == len(sc.GLYPHS) == 36
    bits = sc.text_bitmap("a1")
    assert bits.shape == (5, 7) and not bits[:, 3].any()
    with pytest.raises(ValueError, match="no glyph"):
        sc.text_bitmap("A")


def test_image_size_too_small_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="at least 24"):
        build(make_cfg(tmp_path), image_size=16)


def test_train_and_val_share_no_sample():
    def keys(samples):
        return {
            hashlib.sha256(
                s.question.encode() + b"".join(i.tobytes() for i in s.images(SIZE))
            ).hexdigest()
            for s in samples
        }

    train = keys(sc.scene_samples(sc.TRAIN, 3000))
    val = keys(sc.scene_samples(sc.VAL, 1000))
    assert len(val) > 900  # few repeats within a split
    assert not train & val


def test_single_image_slot_drops_the_two_image_task():
    samples = sc.scene_samples(sc.TRAIN, 400, max_images=1)
    assert all(len(s.pictures) <= 1 for s in samples)
    assert "compare" not in {s.task for s in samples}


# --- rows, labels, images ---------------------------------------------------------------------


def _check_row(ds, i, tok):
    conv = ds.conversations[i]
    s = ds.get(i)
    tokens, labels, images = s.tokens, s.labels, s.images
    assert tokens.shape == labels.shape == (SEQ,) and tokens.dtype == labels.dtype == torch.int64
    assert images.shape == (ds.max_images, 3, SIZE, SIZE) and images.dtype == torch.float32
    # images: TPI placeholders per marker (adjacent markers make one longer run), a filled
    # slot per image, zeros after
    is_img = np.concatenate([[0], (tokens == IMAGE_ID).numpy().astype(np.int8), [0]])
    edges = np.diff(is_img)
    runs = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    assert conv.n_images == sum(h.count(IMAGE_MARKER) for h, _ in conv.turns)
    assert runs.sum() == conv.n_images * TPI and (runs % TPI == 0).all()
    for k in range(ds.max_images):
        assert bool(images[k].abs().sum() > 0) == (k < conv.n_images)
    # padding: eos after the sample, never a label
    n = int(ds.lengths[i])
    assert (tokens[n:] == tok.eos_id).all()
    assert (labels[n - 1 :] == IGNORE_INDEX).all()
    # labels: the next token where it is an answer; they decode back to the answers
    on = labels != IGNORE_INDEX
    assert torch.equal(labels[:-1][on[:-1]], tokens[1:][on[:-1]])
    assert not (labels[on] == IMAGE_ID).any()
    answers = tok.decode(labels[on].tolist()).split(EOS)
    assert answers[-1] == ""
    assert [a.strip() for a in answers[:-1]] == [g for _, g in conv.turns]
    # the prompt is unlabelled and reads as the template
    first = int(on.nonzero()[0])
    prompt = tok.decode([t for t in tokens[: first + 1].tolist() if t != IMAGE_ID])
    assert prompt.startswith("USER: ") and prompt.endswith(" ASSISTANT:")


def test_rows_labels_and_images(scenes_data):
    ds, tok = scenes_data.train, scenes_data.tokenizer
    tasks_seen = set()
    for i in range(120):
        _check_row(ds, i, tok)
        tasks_seen.add(ds.conversations[i].task)
    assert {"compare", "arithmetic", "count"} <= tasks_seen


def test_images_are_clip_normalized(scenes_data):
    ds = scenes_data.train
    i = next(i for i, c in enumerate(ds.conversations) if c.n_images == 1)
    raw = ds.load_images(i)[0]
    got = ds.images(i)[0]
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    want = (torch.from_numpy(raw).permute(2, 0, 1).float() / 255 - mean) / std
    assert torch.allclose(got, want)


def test_tokenizer_places_image_token_and_fits(scenes_data):
    tok = scenes_data.tokenizer
    assert isinstance(tok, Tokenizer)
    assert tok.backend.token_to_id(IMAGE_MARKER) == IMAGE_ID
    assert tok.vocab_size == VOCAB
    info = scenes_data.info
    assert info["train_samples"] == 600 and info["val_samples"] == 256
    assert info["max_sample_tokens"] <= SEQ and 0.1 < info["chance"] < 0.3
    assert set(info["val_tasks"]) <= set(sc.TASKS)


def test_two_builds_in_separate_caches_agree(scenes_data, tmp_path):
    other = build(make_cfg(tmp_path / "other"))
    assert other.tokenizer.to_json() == scenes_data.tokenizer.to_json()
    for ds_a, ds_b in ((scenes_data.train, other.train), (scenes_data.val, other.val)):
        idx = [0, 1, 2, 3, len(ds_a) - 1]
        (xa, ya), (xb, yb) = ds_a.batch(idx), ds_b.batch(idx)
        assert torch.equal(xa.tokens, xb.tokens) and torch.equal(ya, yb)
        assert torch.equal(xa.images, xb.images)
        assert ds_a.fingerprint == ds_b.fingerprint


def test_second_build_reuses_the_cached_tokenizer(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path)
    first = build(cfg)
    monkeypatch.setattr(mm, "train_bpe", lambda *a, **k: pytest.fail("retrained"))
    second = build(cfg)
    assert second.tokenizer.to_json() == first.tokenizer.to_json()
    assert len(list(tmp_path.glob("vlm-tokenizer-*/tokenizer.json"))) == 1


def test_image_token_inside_a_larger_vocab(tmp_path):
    data = build(make_cfg(tmp_path), vocab_size=512, image_token_id=400)
    tok = data.tokenizer
    assert tok.backend.token_to_id(IMAGE_MARKER) == 400 and tok.vocab_size == 401
    x, _ = data.train.batch([0, 1, 2, 3])
    assert int(x.tokens.max()) <= 400


def test_image_token_id_too_low_for_the_bpe(tmp_path):
    with pytest.raises(DataError, match="image_token_id .*at least 257"):
        build(make_cfg(tmp_path), image_token_id=100)


def test_user_tokenizer_with_image_elsewhere(scenes_data, tmp_path):
    path = tmp_path / "tokenizer.json"
    scenes_data.tokenizer.save(path)
    cfg = make_cfg(tmp_path, tokenizer=str(path))
    with pytest.raises(DataError, match="maps '<image>' to id 299 but model.image_token_id is"):
        build(cfg, vocab_size=VOCAB + 10, image_token_id=VOCAB + 5)
    with pytest.raises(DataError, match="vocab_size is 200"):
        build(cfg, vocab_size=200, image_token_id=150)
    same = build(cfg)
    assert same.tokenizer.to_json() == scenes_data.tokenizer.to_json()


def test_seq_len_too_short_names_the_sample(tmp_path):
    with pytest.raises(DataError, match=r"scenes train sample \d+ .*data.seq_len is 40"):
        build(make_cfg(tmp_path, seq_len=40))


# --- loader -----------------------------------------------------------------------------------


def test_loader_batches_and_determinism(scenes_data):
    a = MultimodalLoader(scenes_data.train, 8, SEQ, seed=3)
    b = MultimodalLoader(scenes_data.train, 8, SEQ, seed=3)
    c = MultimodalLoader(scenes_data.train, 8, SEQ, seed=4)
    (xa, ya), (xb, yb), (xc, _) = a.next_batch(), b.next_batch(), c.next_batch()
    assert xa.tokens.shape == ya.shape == (8, SEQ)
    assert xa.images.shape == (8, 2, 3, SIZE, SIZE)
    assert torch.equal(xa.tokens, xb.tokens) and torch.equal(xa.images, xb.images)
    assert torch.equal(ya, yb) and not torch.equal(xa.tokens, xc.tokens)


@pytest.mark.parametrize("k", [1, 36, 37])
def test_loader_resume_matches_uninterrupted(scenes_data, k):
    ds = scenes_data.val  # 256 samples: 7 per batch crosses an epoch after 36 batches
    full = MultimodalLoader(ds, 7, SEQ, seed=11)
    stream = [full.next_batch() for _ in range(k + 3)]
    first = MultimodalLoader(ds, 7, SEQ, seed=11)
    for _ in range(k):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # plain data, as a checkpoint keeps it
    resumed = MultimodalLoader(ds, 7, SEQ, seed=11)
    resumed.load_state_dict(state)
    for x_want, y_want in stream[k:]:
        x, y = resumed.next_batch()
        assert torch.equal(x.tokens, x_want.tokens) and torch.equal(x.images, x_want.images)
        assert torch.equal(y, y_want)


def test_loader_refuses_a_state_from_another_seed_or_dataset(scenes_data):
    state = MultimodalLoader(scenes_data.val, 4, SEQ, seed=1).state_dict()
    assert {"epoch", "index", "seed", "num_sequences", "seq_len", "dataset"} <= set(state)
    with pytest.raises(DataError, match="saved seed=1"):
        MultimodalLoader(scenes_data.val, 4, SEQ, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="saved num_sequences"):
        MultimodalLoader(scenes_data.train, 4, SEQ, seed=1).load_state_dict(state)
    forged = {**state, "num_sequences": len(scenes_data.train)}
    with pytest.raises(DataError, match="saved on dataset"):
        MultimodalLoader(scenes_data.train, 4, SEQ, seed=1).load_state_dict(forged)


def test_val_batches_are_fixed(scenes_data):
    a = multimodal_val_batches(scenes_data.val, 8, SEQ, n_batches=3)
    b = multimodal_val_batches(scenes_data.val, 8, SEQ, n_batches=3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa.tokens, xb.tokens) and torch.equal(ya, yb)
    assert len(multimodal_val_batches(scenes_data.val, 100, SEQ, n_batches=5)) == 2
    with pytest.raises(DataError, match="one batch needs batch_size = 1000"):
        multimodal_val_batches(scenes_data.val, 1000, SEQ, n_batches=1)


# --- evaluation -------------------------------------------------------------------------------


def test_eval_prompts_are_row_prefixes_and_scoring(scenes_data):
    ds, tok = scenes_data.val, scenes_data.tokenizer
    items = eval_prompts(ds, 40)
    assert len(items) == 40
    for i, item in enumerate(items):
        row = ds.get(i)
        p = len(item.prompt)
        assert torch.equal(row.tokens[:p], item.prompt)
        assert torch.equal(row.images, item.images)
        assert tok.decode([t for t in item.prompt.tolist() if t != IMAGE_ID]).endswith("ASSISTANT:")
        assert row.labels[p - 1] != IGNORE_INDEX and row.labels[p - 2] == IGNORE_INDEX
    perfect = score_answers(items, [f"  {it.answer.upper()} " for it in items])
    assert perfect["accuracy"] == 1.0 and perfect["n"] == 40
    chance = sum(it.chance for it in items) / len(items)
    assert perfect["chance"] == pytest.approx(chance)
    wrong = score_answers(items, ["?"] * len(items))
    assert wrong["accuracy"] == 0.0
    for task, row in wrong["by_task"].items():
        assert row["chance"] == sc.TASKS[task].chance and row["n"] >= 1


# --- llava ------------------------------------------------------------------------------------


def _png(path: Path, size=(40, 24), colour=(200, 30, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


GOOD = [
    {
        "id": "a",
        "image": "img/a.png",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat colour?"},
            {"from": "gpt", "value": "red"},
            {"from": "human", "value": "Sure?"},
            {"from": "gpt", "value": "yes"},
        ],
    },
    {
        "id": "b",
        "image": ["img/a.png", "img/b.png"],
        "conversations": [
            {"from": "human", "value": "<image> and <image>: same?"},
            {"from": "gpt", "value": "no"},
        ],
    },
    {
        "id": "c",
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "ok"}],
    },
]


def _write_llava(tmp_path: Path, records, n_copies: int = 4) -> Path:
    _png(tmp_path / "img" / "a.png")
    _png(tmp_path / "img" / "b.png", size=(20, 30), colour=(10, 200, 10))
    path = tmp_path / "train.jsonl"
    lines = []
    for k in range(n_copies):
        for r in records:
            lines.append(json.dumps({**r, "id": f"{r.get('id', '')}{k}"} if "id" in r else r))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_llava_good_file_loads(tmp_path):
    path = _write_llava(tmp_path, GOOD)
    cfg = make_cfg(tmp_path / "cache", source="llava", paths=[str(path)], val_fraction=0.25)
    data = build(cfg)
    assert len(data.train) + len(data.val) == 12 and len(data.val) >= 1
    assert data.tokenizer.backend.token_to_id(IMAGE_MARKER) == IMAGE_ID
    for ds in (data.train, data.val):
        for i in range(len(ds)):
            _check_row(ds, i, data.tokenizer)
    multi = next(i for i, c in enumerate(data.train.conversations) if len(c.turns) == 2)
    labels = data.train.get(multi).labels
    assert data.tokenizer.decode(labels[labels != IGNORE_INDEX].tolist()).count(EOS) == 2
    x, y = MultimodalLoader(data.train, 4, SEQ, seed=0).next_batch()
    assert x.images.shape == (4, 2, 3, SIZE, SIZE)


def test_llava_image_root_and_square_padding(tmp_path):
    _png(tmp_path / "pics" / "a.png", size=(40, 20), colour=(255, 255, 255))
    img = load_image(tmp_path / "pics" / "a.png", 32)
    assert img.shape == (32, 32, 3)
    fill = [int(m * 255) for m in CLIP_MEAN]
    assert img[0, 16].tolist() == fill and img[16, 16].tolist() == [255, 255, 255]
    assert pad_to_square(Image.new("RGB", (5, 5))).size == (5, 5)
    rec = {**GOOD[0], "image": "a.png"}
    path = tmp_path / "data" / "x.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(json.dumps({**rec, "id": k}) for k in range(3)))
    cfg = make_cfg(
        tmp_path / "cache",
        source="llava",
        paths=[str(path.parent)],
        image_root=str(tmp_path / "pics"),
    )
    data = build(cfg)
    assert len(data.train) + len(data.val) == 3


def _bad(**changes):
    rec = json.loads(json.dumps(GOOD[0]))
    rec.update(changes)
    return rec


BAD = {
    "missing_image": (_bad(image="img/nope.png"), r"image file .*nope\.png' does not exist"),
    "count_mismatch": (
        _bad(image=["img/a.png", "img/b.png"]),
        r"1 <image> marker\(s\) in the human turns but 2 image\(s\)",
    ),
    "too_many_images": (
        _bad(
            image=["img/a.png"] * 3,
            conversations=[
                {"from": "human", "value": "<image><image><image>"},
                {"from": "gpt", "value": "x"},
            ],
        ),
        "3 images but data.max_images is 2",
    ),
    "too_long": (
        _bad(
            conversations=[
                {"from": "human", "value": "<image>"},
                {"from": "gpt", "value": "z" * 200},
            ]
        ),
        r"the sample takes \d+ tokens .*data.seq_len is 96",
    ),
    "bad_role": (
        _bad(
            conversations=[{"from": "gpt", "value": "<image>hi"}, {"from": "human", "value": "x"}]
        ),
        "turn 1 is from 'gpt' but 'human' was expected",
    ),
    "ends_with_human": (
        _bad(conversations=[{"from": "human", "value": "<image>"}]),
        "ends with a 'human' turn",
    ),
    "image_in_answer": (
        _bad(
            conversations=[
                {"from": "human", "value": "<image>"},
                {"from": "gpt", "value": "<image>"},
            ]
        ),
        "gpt turn 1 contains '<image>'",
    ),
    "no_conversations": (
        {"id": "bad0", "image": "img/a.png"},
        "lacks field 'conversations'",
    ),
    "bad_image_field": (_bad(image=3), "field 'image' is a int"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_llava_bad_input_names_the_problem(tmp_path, name):
    record, pattern = BAD[name]
    path = _write_llava(tmp_path, GOOD, n_copies=1)
    with path.open("a") as fh:
        fh.write(json.dumps({**record, "id": "bad0"}) + "\n")
    cfg = make_cfg(tmp_path / "cache", source="llava", paths=[str(path)], val_fraction=0.3)
    with pytest.raises(DataError, match=pattern) as err:
        build(cfg)
    if name != "too_long":  # a length error names the first long sample of its split
        assert "JSONL line 4 of file" in str(err.value) and "(id 'bad0')" in str(err.value)
    else:
        assert "(id 'bad0')" in str(err.value)


def test_llava_malformed_json_and_missing_paths(tmp_path):
    path = _write_llava(tmp_path, GOOD, n_copies=1)
    with path.open("a") as fh:
        fh.write("{not json\n")
    cfg = make_cfg(tmp_path / "cache", source="llava", paths=[str(path)])
    with pytest.raises(DataError, match="JSONL line 4 of file .* is not valid JSON"):
        build(cfg)
    with pytest.raises(DataError, match="does not exist"):
        build(make_cfg(tmp_path, source="llava", paths=[str(tmp_path / "none.jsonl")]))
    with pytest.raises(DataError, match="not an image-text source"):
        build(make_cfg(tmp_path, source="stdlib"))


def test_llava_unreadable_image_is_a_data_error_when_loaded(tmp_path):
    path = _write_llava(tmp_path, GOOD, n_copies=2)
    (tmp_path / "img" / "a.png").write_bytes(b"not a png")
    cfg = make_cfg(tmp_path / "cache", source="llava", paths=[str(path)], val_fraction=0.3)
    data = build(cfg)  # images are read lazily
    i = next(i for i, c in enumerate(data.train.conversations) if c.n_images)
    with pytest.raises(DataError, match="cannot read image .*a.png"):
        data.train.get(i)


# --- config -----------------------------------------------------------------------------------


def test_config_knobs_and_problems():
    job = types.SimpleNamespace(model=types.SimpleNamespace(max_seq_len=1024))
    assert DataConfig(source="scenes").problems(job) == []
    assert DataConfig(source="llava", paths=["a.jsonl"]).problems(job) == []
    problems = DataConfig(source="llava", max_images=0, scene_samples=0).problems(job)
    assert "data.source = 'llava' needs data.paths (LLaVA JSONL files or directories)" in problems
    assert "data.max_images must be >= 1, got 0" in problems
    assert "data.scene_samples must be >= 1, got 0" in problems
    assert DataConfig().max_images == 2 and DataConfig().scene_samples == 20000
