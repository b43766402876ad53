"""Tests for the Parquet, Arrow (Hugging Face `datasets`) and Megatron indexed-dataset sources.

Each source is checked against what was written: the documents read back in order with their
stable ids, the packed token streams decode to exactly the documents of each split, and bad
files end in a one-line DataError that names the file and what is wrong. The Megatron files
are written here by a small writer that follows Megatron-LM's `_IndexWriter` layout
independently of the reader under test.
"""

from __future__ import annotations

import json
import os
import struct
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data import make_cfg as data_cfg  # tests/unit is on sys.path under pytest

import hyperloom.data.readers as readers_mod
from hyperloom.config import ConfigError, load_config
from hyperloom.data import DataError, Document, build_data, load_documents, split_documents
from hyperloom.data.megatron import MegatronIndex
from hyperloom.data.tokenizer import train_bpe

VOCAB = 512
EOS = "<|endoftext|>"


def make_cfg(tmp: Path, **overrides) -> types.SimpleNamespace:
    """test_data's config, for small corpora read whole (no subset) by one worker."""
    base = {"source": "parquet", "seq_len": 16, "val_fraction": 0.2, "max_corpus_mb": 0.0}
    return data_cfg(tmp, **{**base, "workers": 1, **overrides})


def texts(n: int, word: str) -> list[str]:
    return [
        f"{word} {i} " + "the quick brown fox jumps over the lazy dog " * (3 + i % 5)
        for i in range(n)
    ]


def split_texts(b, eos_id: int) -> list[list[str]]:
    """Each split's token stream cut at eos and decoded: the documents it packs, in order."""
    out = []
    for ds in (b.train, b.val):
        ids = np.asarray(ds.tokens)
        cuts = np.flatnonzero(ids == eos_id)
        starts = np.concatenate([[0], cuts[:-1] + 1])
        out.append(
            [b.tokenizer.decode(ids[a:c].tolist()) for a, c in zip(starts, cuts, strict=True)]
        )
    return out


def expected_split(docs: list[Document], fraction: float) -> tuple[list[str], list[str]]:
    train, val = split_documents(docs, fraction)
    return [d.text for d in train], [d.text for d in val]


# --- Parquet -----------------------------------------------------------------------------------


def test_parquet_documents_ids_and_packed_splits(tmp_path, monkeypatch):
    monkeypatch.setattr(readers_mod, "BATCH_ROWS", 7)  # many record batches per row group
    body = texts(40, "pq")
    body[5] = None  # a null is skipped, as a blank line is
    body[6] = "   \n"
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"content": body, "n": list(range(40))}), path, row_group_size=16)
    cfg = make_cfg(tmp_path, paths=[str(path)], text_field="content")
    docs = load_documents(cfg)
    assert [d.id for d in docs] == [f"corpus.parquet#{i}" for i in range(40) if i not in (5, 6)]
    assert [d.text for d in docs] == [t for t in body if t and t.strip()]
    b = build_data(cfg, VOCAB)
    assert b.corpus_info["documents"] == 38 and b.corpus_info["source"] == "parquet"
    assert split_texts(b, b.tokenizer.eos_id) == list(expected_split(docs, 0.2))


def test_parquet_errors_name_the_file_and_the_columns(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["a b c"] * 3}), path)
    with pytest.raises(
        DataError, match=r"parquet file '.*c.parquet' has no column 'text' \(columns: body\)"
    ):
        load_documents(make_cfg(tmp_path, paths=[str(path)]))
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), ints)
    with pytest.raises(DataError, match=r"column 'text' holds int values, expected strings"):
        load_documents(make_cfg(tmp_path, paths=[str(ints)]))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all" * 10)
    with pytest.raises(DataError, match=r"cannot read parquet file '.*junk.parquet'"):
        load_documents(make_cfg(tmp_path, paths=[str(junk)]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"directory '.*empty' contains no \*.parquet files"):
        load_documents(make_cfg(tmp_path, paths=[str(tmp_path / "empty")]))


# --- Arrow (HF datasets) -----------------------------------------------------------------------


def test_arrow_save_to_disk_folder_and_ipc_file_format(tmp_path):
    datasets = pytest.importorskip("datasets")
    body = texts(30, "hf")
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": body, "n": list(range(30))}).save_to_disk(
        str(folder), num_shards=3
    )
    shards = sorted(p.name for p in folder.glob("*.arrow"))
    assert len(shards) == 3
    cfg = make_cfg(tmp_path, source="arrow", paths=[str(folder)])
    docs = load_documents(cfg)
    assert [d.text for d in docs] == body  # the shards in order, every row
    assert docs[0].id == f"{shards[0]}#0" and docs[-1].id == f"{shards[-1]}#9"
    b = build_data(cfg, VOCAB)
    assert split_texts(b, b.tokenizer.eos_id) == list(expected_split(docs, 0.2))
    # Arrow's random-access file format reads the same rows.
    ipc = tmp_path / "table.arrow"
    with (
        pa.OSFile(str(ipc), "wb") as sink,
        pa.ipc.new_file(sink, pa.schema([("text", pa.string())])) as w,
    ):
        for lo in range(0, 30, 8):
            w.write_batch(pa.record_batch([pa.array(body[lo : lo + 8])], names=["text"]))
    assert [
        d.text for d in load_documents(make_cfg(tmp_path, source="arrow", paths=[str(ipc)]))
    ] == body


def test_arrow_files_of_the_hf_cache(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lines = texts(12, "cached")
    src = tmp_path / "raw.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    ds = datasets.load_dataset(
        "json", data_files=str(src), split="train", cache_dir=str(tmp_path / "hf")
    )
    files = [f["filename"] for f in ds.cache_files]
    assert files and all(f.endswith(".arrow") for f in files)
    docs = load_documents(make_cfg(tmp_path, source="arrow", paths=files))
    assert [d.text for d in docs] == lines


def test_arrow_without_the_column(tmp_path):
    path = tmp_path / "t.arrow"
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_stream(sink, pa.schema([("x", pa.string())])) as w,
    ):
        w.write_batch(pa.record_batch([pa.array(["a"])], names=["x"]))
    with pytest.raises(
        DataError, match=r"arrow file '.*t.arrow' has no column 'text' \(columns: x\)"
    ):
        load_documents(make_cfg(tmp_path, source="arrow", paths=[str(path)]))


# --- Megatron indexed datasets -----------------------------------------------------------------


def write_megatron(
    prefix: Path, docs: list[list[list[int]]], dtype=np.uint16, code: int = 8
) -> None:
    """`prefix.bin` / `prefix.idx` as Megatron-LM's IndexedDatasetBuilder writes them: every
    document a list of sequences of token ids."""
    lengths, doc_index = [], [0]
    with open(f"{prefix}.bin", "wb") as fh:
        for doc in docs:
            for seq in doc:
                fh.write(np.asarray(seq, dtype=dtype).tobytes())
                lengths.append(len(seq))
            doc_index.append(len(lengths))
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        fh.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index)))
        fh.write(np.asarray(lengths, dtype=np.int32).tobytes())
        fh.write(np.asarray(pointers, dtype=np.int64).tobytes())
        fh.write(np.asarray(doc_index, dtype=np.int64).tobytes())


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> tuple[Path, object]:
    tmp = tmp_path_factory.mktemp("tok")
    docs = [Document(str(i), t) for i, t in enumerate(texts(60, "meg"))]
    tok = train_bpe(docs, VOCAB, EOS)
    tok.save(tmp / "tokenizer.json")
    return tmp / "tokenizer.json", tok


def megatron_corpus(tmp: Path, tok) -> tuple[Path, list[str]]:
    """20 documents, most split into 1-3 'sentence' sequences, one empty, two ending in eos."""
    bodies = texts(20, "mg")
    docs = []
    for i, body in enumerate(bodies):
        ids = tok.encode(body)
        cut = [len(ids) // 3, 2 * len(ids) // 3] if i % 3 == 0 else []
        seqs = [s.tolist() for s in np.split(np.asarray(ids), cut)] if cut else [ids]
        if i in (4, 9):
            seqs[-1] = seqs[-1] + [tok.eos_id]  # preprocess_data.py --append-eod
        docs.append(seqs)
    docs.insert(7, [])  # a document of no sequences
    prefix = tmp / "corpus_text_document"
    write_megatron(prefix, docs)
    return prefix, bodies


def test_megatron_documents_split_and_eos(tmp_path, tokenizer_file):
    path, tok = tokenizer_file
    prefix, bodies = megatron_corpus(tmp_path, tok)
    index = MegatronIndex.read(Path(f"{prefix}.idx"))
    assert index.num_documents == 21 and index.dtype == np.uint16
    cfg = make_cfg(tmp_path, source="megatron", paths=[str(prefix)], tokenizer=str(path))
    b = build_data(cfg, VOCAB)
    assert b.corpus_info["documents"] == 20  # the empty one is no document
    # Document k keeps its number (7 is the empty one), and the split is by that id's hash.
    numbers = [k for k in range(21) if k != 7]
    docs = [Document(f"corpus_text_document#{k}", t) for k, t in zip(numbers, bodies, strict=True)]
    assert split_texts(b, tok.eos_id) == list(expected_split(docs, 0.2))
    # One eos per document: those that ended with one did not get a second.
    eos = sum(int((np.asarray(ds.tokens) == tok.eos_id).sum()) for ds in (b.train, b.val))
    assert eos == 20
    # The .bin, the .idx or a directory name the same dataset.
    for given in (f"{prefix}.bin", f"{prefix}.idx", str(tmp_path)):
        again = build_data(
            make_cfg(tmp_path, source="megatron", paths=[given], tokenizer=str(path)), VOCAB
        )
        assert np.array_equal(again.train.tokens, b.train.tokens)


def test_megatron_needs_its_tokenizer_and_ids_inside_it(tmp_path, tokenizer_file):
    path, tok = tokenizer_file
    prefix, _ = megatron_corpus(tmp_path, tok)
    with pytest.raises(DataError, match=r"megatron dataset holds token ids .* set data.tokenizer"):
        build_data(make_cfg(tmp_path, source="megatron", paths=[str(prefix)]), VOCAB)
    with pytest.raises(
        ConfigError, match=r"data.source = 'megatron' reads token ids; set data.tokenizer"
    ):
        load_config(None, ["--data.source", "megatron", "--data.paths", str(prefix)], world_size=1)
    bad = tmp_path / "bad"
    write_megatron(bad, [[[1, 2, 3]], [[5, VOCAB + 3, 7]]])
    with pytest.raises(
        DataError, match=rf"'.*bad': document 1 holds token id {VOCAB + 3}, outside"
    ):
        build_data(
            make_cfg(tmp_path, source="megatron", paths=[str(bad)], tokenizer=str(path)), VOCAB
        )


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: _patch(p, 0, b"MMIDIDY"), r"is not a Megatron index: it does not start with"),
        (lambda p: _patch(p, 9, struct.pack("<Q", 2)), r"has index version 2; only version 1"),
        (lambda p: _patch(p, 17, struct.pack("<B", 7)), r"dtype code 7 \(float32\); token ids need"),
        (lambda p: _patch(p, 17, struct.pack("<B", 42)), r"dtype code 42 \(unknown\)"),
        (lambda p: p.write_bytes(p.read_bytes()[:-8]), r"is \d+ bytes, but its header promises"),
        (lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes()[:-2]),
         r"the sequences hold \d+ bytes but the .bin has"),
        (lambda p: _patch(p, 34 + 4 * 3, struct.pack("<q", 2)), r"byte offsets near sequence 0 do not follow"),
        (lambda p: p.with_suffix(".bin").unlink(), r"has no data file beside it \(.bin\)"),
    ],
    ids=["magic", "version", "float-dtype", "unknown-dtype", "truncated-idx", "short-bin",
         "pointers", "no-bin"],
)  # fmt: skip
def test_megatron_damaged_files_are_refused_by_name(tmp_path, tokenizer_file, damage, message):
    path, _ = tokenizer_file
    write_megatron(tmp_path / "m", [[[1, 2], [3]], [[4, 5, 6]]])  # 3 sequences, 2 documents
    damage(tmp_path / "m.idx")
    with pytest.raises(DataError, match=message):
        build_data(
            make_cfg(tmp_path, source="megatron", paths=[str(tmp_path / "m")], tokenizer=str(path)),
            VOCAB,
        )


def test_megatron_int32_tokens(tmp_path, tokenizer_file):
    """Vocabularies of 65,500 and more are written as int32 (dtype code 4)."""
    path, tok = tokenizer_file
    docs = [[tok.encode(t)] for t in texts(10, "wide")]
    write_megatron(tmp_path / "w", docs, dtype=np.int32, code=4)
    b = build_data(
        make_cfg(tmp_path, source="megatron", paths=[str(tmp_path / "w")], tokenizer=str(path)),
        VOCAB,
    )
    assert sum(len(s) for s in split_texts(b, tok.eos_id)) == 10


# --- text files stream ---------------------------------------------------------------------------


def test_text_split_at_eos_streams_across_block_boundaries(tmp_path, monkeypatch):
    """A file read in blocks smaller than an eos token splits exactly as read whole."""
    import hyperloom.data.corpus as corpus_mod

    parts = [f"story {i} " + "é" * (i * 3) for i in range(12)]
    parts[4] = "  \n"  # blank: skipped, but it keeps its number
    (tmp_path / "joined.txt").write_text(EOS.join(parts))
    cfg = make_cfg(tmp_path, source="text", paths=[str(tmp_path / "joined.txt")])
    whole = load_documents(cfg)
    monkeypatch.setattr(corpus_mod, "_READ_CHARS", 5)
    assert load_documents(cfg) == whole
    assert [d.id for d in whole] == [f"joined.txt#{k}" for k in range(12) if k != 4]
    assert [d.text for d in whole] == [p for k, p in enumerate(parts) if k != 4]
    assert os.path.getsize(tmp_path / "joined.txt") > 5
