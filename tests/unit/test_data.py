"""Tests for hyperloom.data: corpora, split, tokenizer, caching, packing and the loader."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import hyperloom.data.build as build_mod
from hyperloom.data import (
    DataError,
    ResumableLoader,
    TokenDataset,
    Tokenizer,
    build_data,
    load_documents,
    select_subset,
    split_documents,
    val_batches,
)

VOCAB = 512
EOS = "<|endoftext|>"


def make_cfg(tmp: Path, **overrides) -> types.SimpleNamespace:
    cfg = dict(
        source="stdlib",
        paths=[],
        text_field="text",
        tokenizer="",
        eos_token=EOS,
        seq_len=64,
        val_fraction=0.1,
        max_corpus_mb=0.5,
        cache_dir=str(tmp / "cache"),
        workers=0,
        blend=[],
    )
    cfg.update(overrides)
    return types.SimpleNamespace(**cfg)


@pytest.fixture(scope="module")
def stdlib_build(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stdlib")
    cfg = make_cfg(tmp)
    return cfg, build_data(cfg, VOCAB)


def write_text_corpus(root: Path, n_files: int = 12) -> list[str]:
    """Text files of unique marker words; returns the markers, one per document."""
    root.mkdir(parents=True, exist_ok=True)
    markers = []
    for i in range(n_files):
        marker = f"zq{i:03d}marker"
        markers.append(marker)
        body = f"{marker} the quick brown fox jumps over the lazy dog {i}.\n" * 40
        (root / f"doc{i:02d}.txt").write_text(body)
    return markers


# --- stdlib build -----------------------------------------------------------------------------


def test_stdlib_build_shapes_and_ids(stdlib_build):
    cfg, b = stdlib_build
    info = b.corpus_info
    assert info["source"] == "stdlib" and not info["cache_hit"]
    assert info["train_documents"] > 0 and info["val_documents"] > 0
    assert info["documents"] == info["train_documents"] + info["val_documents"]
    assert 0.4e6 <= info["bytes"] <= 1.0e6  # max_corpus_mb=0.5 plus at most one document
    assert b.tokenizer.vocab_size == VOCAB
    for ds, key in ((b.train, "train_tokens"), (b.val, "val_tokens")):
        assert len(ds) == info[key] > 0
        assert ds.tokens.dtype == np.uint16
        assert int(ds.tokens.max()) < VOCAB
    # Every document is followed by eos, so each split holds exactly its document count.
    assert int((np.asarray(b.train.tokens) == b.tokenizer.eos_id).sum()) == info["train_documents"]
    assert int((np.asarray(b.val.tokens) == b.tokenizer.eos_id).sum()) == info["val_documents"]


def test_split_is_disjoint_deterministic_and_nonempty(tmp_path):
    cfg = make_cfg(tmp_path)
    docs = select_subset(load_documents(cfg), cfg.max_corpus_mb)
    train, val = split_documents(docs, cfg.val_fraction)
    train_ids, val_ids = {d.id for d in train}, {d.id for d in val}
    assert train_ids and val_ids and not train_ids & val_ids
    assert train_ids | val_ids == {d.id for d in docs}
    assert split_documents(docs, cfg.val_fraction) == (train, val)
    # Fraction 0 still holds one document out; the subset is not an alphabetical prefix.
    assert len(split_documents(docs, 0.0)[1]) == 1
    all_ids = [d.id for d in load_documents(cfg)]
    assert [d.id for d in docs] != all_ids[: len(docs)]


def test_build_puts_each_document_in_exactly_one_split(tmp_path):
    markers = write_text_corpus(tmp_path / "corpus", n_files=20)
    cfg = make_cfg(tmp_path, source="text", paths=[str(tmp_path / "corpus")], val_fraction=0.2)
    b = build_data(cfg, VOCAB)
    train_text = b.tokenizer.decode(np.asarray(b.train.tokens).tolist())
    val_text = b.tokenizer.decode(np.asarray(b.val.tokens).tolist())
    in_val = [m for m in markers if m in val_text]
    assert in_val and len(in_val) < len(markers)
    for m in markers:
        assert (m in train_text) != (m in val_text), m


# --- caching ----------------------------------------------------------------------------------


def test_second_build_reuses_cache_without_retraining(stdlib_build, monkeypatch):
    cfg, first = stdlib_build
    folder = Path(first.corpus_info["cache_dir"])
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def forbidden(*args, **kwargs):
        raise AssertionError("cache hit must not retrain or retokenize")

    monkeypatch.setattr(build_mod, "train_bpe", forbidden)
    monkeypatch.setattr(build_mod, "take_census", forbidden)  # reads the corpus
    monkeypatch.setattr(build_mod, "encode_sources", forbidden)
    second = build_data(cfg, VOCAB)
    assert second.corpus_info["cache_hit"]
    assert np.array_equal(second.train.tokens, first.train.tokens)
    assert np.array_equal(second.val.tokens, first.val.tokens)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_cache_key_follows_config_and_file_changes(tmp_path):
    write_text_corpus(tmp_path / "corpus")
    cfg = make_cfg(tmp_path, source="text", paths=[str(tmp_path / "corpus")], seq_len=16)
    a = build_data(cfg, VOCAB).corpus_info["cache_dir"]
    cfg.val_fraction = 0.3
    b = build_data(cfg, VOCAB).corpus_info["cache_dir"]
    assert a != b
    (tmp_path / "corpus" / "doc00.txt").write_text("edited " * 300)
    c = build_data(cfg, VOCAB)
    assert c.corpus_info["cache_dir"] != b and not c.corpus_info["cache_hit"]


# --- text and JSONL sources -------------------------------------------------------------------


def test_text_source_splits_files_on_eos(tmp_path):
    root = tmp_path / "corpus"
    write_text_corpus(root, n_files=3)
    (root / "joined.txt").write_text(EOS.join(f"story {i} " * 50 for i in range(5)))
    (root / "ignored.md").write_text("not a .txt file")
    cfg = make_cfg(tmp_path, source="text", paths=[str(root)], seq_len=16)
    docs = load_documents(cfg)
    assert len(docs) == 3 + 5
    assert all(EOS not in d.text and "not a .txt" not in d.text for d in docs)
    b = build_data(cfg, VOCAB)
    assert b.corpus_info["documents"] == 8 and len(b.val) > 16


def test_jsonl_source(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"body": f"record {i} " * 60, "id": i}) for i in range(10)]
    lines.insert(3, "")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n")
    cfg = make_cfg(tmp_path, source="jsonl", paths=[str(path)], text_field="body", seq_len=16)
    docs = load_documents(cfg)
    assert len(docs) == 10 and docs[0].text.startswith("record 0 ")
    b = build_data(cfg, VOCAB)
    assert b.corpus_info["documents"] == 10
    assert "record" in b.tokenizer.decode(b.train.sequence(0, 16)[0].tolist())


def test_user_tokenizer_file(stdlib_build, tmp_path):
    cfg, b = stdlib_build
    tok_path = tmp_path / "tokenizer.json"
    b.tokenizer.save(tok_path)
    user_cfg = make_cfg(tmp_path, tokenizer=str(tok_path))
    ub = build_data(user_cfg, 1024)  # a model vocab larger than the tokenizer is fine
    assert ub.corpus_info["tokenizer"] == str(tok_path)
    assert ub.tokenizer.vocab_size == VOCAB
    # Same corpus, split and tokenizer: the packed streams must match the built-in build.
    assert np.array_equal(ub.train.tokens, b.train.tokens)
    assert np.array_equal(ub.val.tokens, b.val.tokens)


# --- errors -----------------------------------------------------------------------------------


def test_error_unknown_source_and_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"unknown data source 'hdf5'; allowed: stdlib"):
        build_data(make_cfg(tmp_path, source="hdf5"), VOCAB)
    with pytest.raises(DataError, match=r"data path '.*nope' does not exist"):
        build_data(make_cfg(tmp_path, source="text", paths=[str(tmp_path / "nope")]), VOCAB)


def test_error_empty_corpus(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    cfg = make_cfg(tmp_path, source="jsonl", paths=[str(tmp_path / "empty.jsonl")])
    with pytest.raises(DataError, match=r"corpus is empty"):
        build_data(cfg, VOCAB)


def test_error_jsonl_bad_line_and_missing_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"JSONL line 2 of file '.*bad.jsonl' is not valid JSON"):
        load_documents(make_cfg(tmp_path, source="jsonl", paths=[str(bad)]))
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "fine"}\n\n{"content": "x"}\n')
    with pytest.raises(DataError, match=r"line 3 of file '.*nofield.jsonl' lacks field 'text'"):
        load_documents(make_cfg(tmp_path, source="jsonl", paths=[str(nofield)]))


def test_error_tokenizer_eos_missing_and_vocab_too_large(stdlib_build, tmp_path):
    _, b = stdlib_build
    tok_path = tmp_path / "tok.json"
    b.tokenizer.save(tok_path)
    cfg = make_cfg(tmp_path, tokenizer=str(tok_path), eos_token="<|eot|>")
    with pytest.raises(DataError, match=r"eos token '<\|eot\|>' is not in the tokenizer"):
        build_data(cfg, VOCAB)
    cfg = make_cfg(tmp_path, tokenizer=str(tok_path))
    with pytest.raises(DataError, match=r"has 512 tokens but the model's vocab_size is 300"):
        build_data(cfg, 300)


def test_error_seq_len_larger_than_val_split(stdlib_build):
    cfg, b = stdlib_build
    too_long = len(b.val)  # one window needs seq_len + 1 tokens
    big = types.SimpleNamespace(**{**vars(cfg), "seq_len": too_long})
    with pytest.raises(DataError, match=rf"seq_len\({too_long}\) is larger than the val split"):
        build_data(big, VOCAB)


def test_error_val_batches_shows_arithmetic():
    ds = TokenDataset(np.arange(1234, dtype=np.uint16), "validation")
    msg = r"validation split has 1,234 tokens; one batch needs batch_size\(8\) x seq_len\(256\)"
    with pytest.raises(DataError, match=msg + r" \+ 1 = 2,049"):
        val_batches(ds, batch_size=8, seq_len=256, n_batches=4)


def test_error_loader_state_from_other_dataset_or_seed():
    small = TokenDataset(np.arange(41, dtype=np.uint16))
    big = TokenDataset(np.arange(81, dtype=np.uint16))
    state = ResumableLoader(small, 3, 4, seed=1).state_dict()
    with pytest.raises(DataError, match=r"saved num_sequences=10, this loader has .*=20"):
        ResumableLoader(big, 3, 4, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match=r"saved seed=1, this loader has seed=2"):
        ResumableLoader(small, 3, 4, seed=2).load_state_dict(state)


# --- tokenizer --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["", "def f(x):\n\treturn x  # tab\n", "naïve café 日本語 🙂\r\n", f"a{EOS}b", "  lead\n\n\n"],
)
def test_tokenizer_round_trip(stdlib_build, text):
    tok = stdlib_build[1].tokenizer
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_save_load_same_ids(stdlib_build, tmp_path):
    tok = stdlib_build[1].tokenizer
    tok.save(tmp_path / "t.json")
    again = Tokenizer.load(tmp_path / "t.json")
    text = "import os\nprint(os.getcwd())\n"
    assert again.encode(text) == tok.encode(text) and again.eos_id == tok.eos_id


# --- dataset and loader -----------------------------------------------------------------------


def test_sequences_are_shifted_windows():
    ds = TokenDataset(np.arange(41, dtype=np.uint16))
    assert ds.num_sequences(4) == 10 and ds.num_sequences(40) == 1 and ds.num_sequences(41) == 0
    x, y = ds.sequence(9, 4)
    assert x.dtype == torch.int64 and x.shape == (4,)
    assert x.tolist() == [36, 37, 38, 39] and y.tolist() == [37, 38, 39, 40]
    with pytest.raises(IndexError):
        ds.sequence(10, 4)


def test_loader_deterministic_and_labels_shifted(stdlib_build):
    train = stdlib_build[1].train
    a, b = ResumableLoader(train, 4, 32, seed=7), ResumableLoader(train, 4, 32, seed=7)
    for _ in range(5):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert xa.shape == ya.shape == (4, 32) and xa.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])


def test_loader_different_seed_differs(stdlib_build):
    train = stdlib_build[1].train
    a, b = ResumableLoader(train, 4, 32, seed=7), ResumableLoader(train, 4, 32, seed=8)
    assert not all(torch.equal(a.next_batch()[0], b.next_batch()[0]) for _ in range(3))


def test_loader_epochs_cover_every_sequence_once():
    ds = TokenDataset(np.arange(41, dtype=np.uint16))  # 10 sequences of 4
    loader = ResumableLoader(ds, batch_size=5, seq_len=4, seed=3)
    firsts = torch.cat([loader.next_batch()[0][:, 0] for _ in range(4)])  # two epochs
    assert sorted(firsts[:10].tolist()) == sorted(firsts[10:].tolist()) == list(range(0, 40, 4))
    assert firsts[:10].tolist() != firsts[10:].tolist()  # each epoch has its own order
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["index"] == 0
    plain = ResumableLoader(ds, batch_size=5, seq_len=4, seed=3, shuffle=False)
    assert plain.next_batch()[0][:, 0].tolist() == [0, 4, 8, 12, 16]


@pytest.mark.parametrize("k", [1, 3, 4])
def test_loader_resume_matches_uninterrupted(k):
    ds = TokenDataset(np.arange(41, dtype=np.uint16))  # 10 sequences; batches of 3 straddle
    ref = ResumableLoader(ds, batch_size=3, seq_len=4, seed=11)
    expected = [ref.next_batch() for _ in range(12)]  # 36 sequences: crosses 3 epoch bounds
    first = ResumableLoader(ds, batch_size=3, seq_len=4, seed=11)
    for _ in range(k):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # must survive plain serialization
    resumed = ResumableLoader(ds, batch_size=3, seq_len=4, seed=11)
    resumed.load_state_dict(state)
    for x, y in expected[k:]:
        rx, ry = resumed.next_batch()
        assert torch.equal(rx, x) and torch.equal(ry, y)
    assert resumed.state_dict() == ref.state_dict()


def test_val_batches_fixed_and_truncated():
    ds = TokenDataset(np.arange(41, dtype=np.uint16))  # 10 sequences of 4 -> 3 batches of 3
    batches = val_batches(ds, batch_size=3, seq_len=4, n_batches=5)
    assert len(batches) == 3
    assert batches[1][0][:, 0].tolist() == [12, 16, 20]
    # fewer batches than fit: spread over the whole split, the same ones every time
    two = val_batches(ds, batch_size=3, seq_len=4, n_batches=2)
    assert [b[0][:, 0].tolist() for b in two] == [[0, 4, 12], [20, 24, 32]]  # k * 10 // 6
    again = val_batches(ds, batch_size=3, seq_len=4, n_batches=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, two, strict=True))


def test_env_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERLOOM_CACHE", str(tmp_path / "envcache"))
    cfg = make_cfg(tmp_path, cache_dir="")
    assert build_mod.cache_root(cfg) == tmp_path / "envcache"
    monkeypatch.delenv("HYPERLOOM_CACHE")
    assert build_mod.cache_root(cfg) == Path(os.path.expanduser("~/.cache/hyperloom"))


# --- a cache that is not a directory, or not whole ----------------------------------------


def test_error_cache_dir_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    cfg = make_cfg(tmp_path, cache_dir=str(tmp_path / "afile"))
    with pytest.raises(
        DataError, match=r"cannot create the data cache '.*afile/data-.*data\.cache_dir"
    ):
        build_data(cfg, VOCAB)


def _damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "name,damage",
    [
        ("train.npy", _damage_truncate),
        ("val.npy", lambda p: p.write_bytes(b"")),
        ("train.npy", lambda p: p.write_bytes(os.urandom(300))),
        ("val.npy", lambda p: np.save(p, np.arange(4, dtype=np.float32))),
        ("train.npy", lambda p: np.save(p, np.arange(50, dtype=np.uint16))),
        ("info.json", lambda p: p.write_text("[1, 2]")),
        ("info.json", _damage_truncate),
        ("tokenizer.json", _damage_truncate),
    ],
    ids=["truncated", "empty", "binary", "float-ids", "wrong-length", "json-list",
         "truncated-info", "truncated-tokenizer"],
)  # fmt: skip
def test_a_damaged_cache_is_built_again(tmp_path, caplog, name, damage):
    write_text_corpus(tmp_path / "corpus")
    cfg = make_cfg(tmp_path, source="text", paths=[str(tmp_path / "corpus")], seq_len=16)
    first = build_data(cfg, VOCAB)
    folder = Path(first.corpus_info["cache_dir"])
    train, val = np.array(first.train.tokens), np.array(first.val.tokens)
    del first  # the memory maps, before their files change
    damage(folder / name)
    with caplog.at_level("WARNING", logger="hyperloom.data"):
        again = build_data(cfg, VOCAB)
    assert not again.corpus_info["cache_hit"]
    assert name in caplog.text and "damaged" in caplog.text
    assert np.array_equal(again.train.tokens, train) and np.array_equal(again.val.tokens, val)
    assert build_data(cfg, VOCAB).corpus_info["cache_hit"]  # whole again


def test_user_tokenizer_given_as_its_directory(stdlib_build, tmp_path):
    _, b = stdlib_build
    b.tokenizer.save(tmp_path / "tokenizer.json")
    ub = build_data(make_cfg(tmp_path, tokenizer=str(tmp_path)), VOCAB)
    assert ub.tokenizer.vocab_size == VOCAB


def test_tokenizer_to_json_is_what_save_writes(stdlib_build, tmp_path):
    _, b = stdlib_build
    b.tokenizer.save(tmp_path / "tokenizer.json")
    assert (tmp_path / "tokenizer.json").read_bytes() == b.tokenizer.to_json()


def test_a_huge_vocab_size_stops_where_the_corpus_does():
    """The BPE trainer sizes its tables by vocab_size: 1e11 aborted the process (out of
    memory in Rust). No corpus allows more merges than it has bytes."""
    from hyperloom.data import Document
    from hyperloom.data.tokenizer import train_bpe

    docs = [Document(str(i), f"def f{i}(x): return x * {i}\n" * 5) for i in range(20)]
    tok = train_bpe(docs, 10**11, EOS)
    assert 257 <= tok.vocab_size <= 257 + sum(d.nbytes for d in docs)
