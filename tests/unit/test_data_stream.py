"""Tests for the streaming build: identical files for any number of tokenizer workers, the
streamed subset and split equal to the in-memory rules, a corpus changed mid-build refused,
progress bars, and memory that does not grow with the corpus (a 40 MB corpus built in a
subprocess whose peak resident memory may grow by a quarter of that at most).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data_sources import make_cfg, write_megatron  # tests/unit is on sys.path under pytest

import hyperloom.data.build as build_mod
import hyperloom.data.stream as stream_mod
from hyperloom.config.data import BlendSource
from hyperloom.data import DataError, build_data, load_documents, select_subset, split_documents
from hyperloom.data.readers import file_documents, resolve_files

VOCAB = 512
EOS = "<|endoftext|>"


def words(i: int, n: int) -> str:
    return " ".join(
        f"{w}{(i * 7 + k) % 13}" for k, w in zip(range(n), ["ab", "cd", "ef"] * n, strict=False)
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A text folder (some files split at eos), a JSONL file and a Parquet file."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "txt").mkdir()
    for i in range(15):
        body = EOS.join(words(i * 10 + j, 40 + j) for j in range(1 + i % 3))
        (root / "txt" / f"f{i:02d}.txt").write_text(body)
    with open(root / "c.jsonl", "w") as fh:
        for i in range(60):
            fh.write(json.dumps({"text": words(1000 + i, 30 + i % 11)}) + "\n")
    pq.write_table(pa.table({"text": [words(5000 + i, 50) for i in range(40)]}), root / "c.parquet")
    return root


def blend_cfg(tmp: Path, corpus: Path, workers: int, **kw) -> types.SimpleNamespace:
    """A blend of the three files, cached per worker count (so that both builds run)."""
    blend = [
        BlendSource("text", [str(corpus / "txt")]),
        BlendSource("jsonl", [str(corpus / "c.jsonl")], weight=2.0),
        BlendSource("parquet", [str(corpus / "c.parquet")]),
    ]
    cache = str(tmp / f"cache{workers}")
    return make_cfg(tmp, source="blend", blend=blend, workers=workers, cache_dir=cache, **kw)


def cache_files(bundle) -> dict[str, bytes]:
    folder = Path(bundle.corpus_info["cache_dir"])
    built_in = bundle.corpus_info["tokenizer"] == "built-in byte-level BPE"
    names = ["train.npy", "val.npy"] + (["tokenizer.json"] if built_in else [])
    return {n: (folder / n).read_bytes() for n in names}


def test_one_and_three_workers_write_the_same_bytes(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(stream_mod, "CHUNK_BYTES", 2000)  # dozens of chunks in flight
    one = build_data(blend_cfg(tmp_path, corpus, workers=1), VOCAB)
    three = build_data(blend_cfg(tmp_path, corpus, workers=3), VOCAB)
    assert one.corpus_info["cache_dir"] != three.corpus_info["cache_dir"]
    assert cache_files(one) == cache_files(three)
    # ... and both are each source's split, tokenized document by document, eos after each.
    tok = one.tokenizer
    for i, entry in enumerate(blend_cfg(tmp_path, corpus, 1).blend):
        cfg = make_cfg(tmp_path, source=entry.source, paths=entry.paths)
        train, val = split_documents(load_documents(cfg), 0.2)
        for split, docs in (("train", train), ("val", val)):
            expected = [t for d in docs for t in [*tok.encode(d.text), tok.eos_id]]
            seg = getattr(one, split).segments[i]
            assert np.asarray(getattr(one, split).tokens)[seg.start : seg.stop].tolist() == expected


def test_megatron_blocks_keep_their_place_among_worker_results(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(stream_mod, "CHUNK_BYTES", 2000)
    base = build_data(blend_cfg(tmp_path, corpus, workers=1), VOCAB)
    tok_file = tmp_path / "tokenizer.json"
    base.tokenizer.save(tok_file)
    write_megatron(tmp_path / "m", [[base.tokenizer.encode(words(i, 25))] for i in range(30)])
    megatron = BlendSource("megatron", [str(tmp_path / "m")])

    def cfg(workers):
        c = blend_cfg(tmp_path, corpus, workers, tokenizer=str(tok_file))
        c.blend = [c.blend[0], megatron, c.blend[1]]
        return c

    assert cache_files(build_data(cfg(1), VOCAB)) == cache_files(build_data(cfg(2), VOCAB))


def test_streamed_subset_and_split_equal_the_in_memory_rules(tmp_path, corpus):
    cfg = make_cfg(
        tmp_path,
        source="jsonl",
        paths=[str(corpus / "c.jsonl")],
        val_fraction=0.3,
        max_corpus_mb=0.004,
    )
    b = build_data(cfg, VOCAB)
    docs = select_subset(load_documents(cfg), cfg.max_corpus_mb)
    assert 0 < len(docs) < 60
    train, val = split_documents(docs, cfg.val_fraction)
    assert (b.corpus_info["train_documents"], b.corpus_info["val_documents"]) == (
        len(train),
        len(val),
    )
    expected = [t for d in val for t in [*b.tokenizer.encode(d.text), b.tokenizer.eos_id]]
    assert np.asarray(b.val.tokens).tolist() == expected


def test_a_file_changed_during_the_build_is_refused(tmp_path, corpus, monkeypatch):
    root = tmp_path / "copy"
    root.mkdir()
    (root / "c.jsonl").write_bytes((corpus / "c.jsonl").read_bytes())
    real = build_mod.choose_all

    def choose_then_append(*args):
        real(*args)
        with open(root / "c.jsonl", "a") as fh:
            fh.write(json.dumps({"text": "a late line"}) + "\n")

    monkeypatch.setattr(build_mod, "choose_all", choose_then_append)
    cfg = make_cfg(tmp_path, source="jsonl", paths=[str(root)])
    with pytest.raises(
        DataError, match=r"data file '.*c.jsonl' changed while the cache was being built"
    ):
        build_data(cfg, VOCAB)
    folder = next((tmp_path / "cache").iterdir())
    assert not (folder / "info.json").exists() and not list(folder.glob("*.tmp"))


def test_a_blend_cache_with_wrong_source_counts_is_built_again(tmp_path, corpus, caplog):
    cfg = blend_cfg(tmp_path, corpus, workers=1)
    first = build_data(cfg, VOCAB)
    info_path = Path(first.corpus_info["cache_dir"]) / "info.json"
    train = np.array(first.train.tokens)
    del first
    info = json.loads(info_path.read_text())
    info["sources"] = info["sources"][:2]
    info_path.write_text(json.dumps(info))
    with caplog.at_level("WARNING", logger="hyperloom.data"):
        again = build_data(cfg, VOCAB)
    assert "damaged" in caplog.text and "per-source counts" in caplog.text
    assert not again.corpus_info["cache_hit"] and np.array_equal(again.train.tokens, train)


def test_progress_bars_on_the_console(tmp_path, corpus, capsys):
    cfg = blend_cfg(tmp_path, corpus, workers=1)
    build_data(cfg, VOCAB, progress=True)
    err = capsys.readouterr().err
    assert "reading" in err and "tokenizing" in err


def test_file_documents_stream_one_at_a_time(corpus):
    """Readers are generators: the first document arrives before the file is read through."""
    f = resolve_files(make_cfg(corpus, source="jsonl", paths=[str(corpus / "c.jsonl")]))[0]
    docs = file_documents("jsonl", f, "text", EOS)
    assert next(docs).id == "c.jsonl#1"
    assert sum(1 for _ in docs) == 59


# --- memory: a corpus several times larger than the memory the build may add ------------------

CORPUS_MB = 40
ALLOWED_GROWTH_MB = CORPUS_MB / 4

_RSS_SCRIPT = """
import json, os, random, sys, types
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers
import hyperloom.data.pool as pool
import hyperloom.data.stream as stream
from hyperloom.data import build_data

root, corpus_mb = Path(sys.argv[1]), float(sys.argv[2])
words = [f"w{i}" for i in range(2000)]
vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))  # fast: the test is about memory
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(str(root / "tokenizer.json"))
rng, n = random.Random(0), 0
with open(root / "big.jsonl", "w") as fh:  # written a line at a time
    while n < corpus_mb * 1e6:
        line = json.dumps({"text": " ".join(rng.choices(words, k=1500))}) + "\\n"
        fh.write(line)
        n += len(line)


def status(key):  # kB -> bytes; VmHWM is the peak since exec (ru_maxrss is not: it keeps
    for line in open("/proc/self/status"):  # the peak of the process that forked us)
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


init, encode = pool._init_worker, pool._encode_in_worker


def init_measured(*args):  # each worker notes its size once it holds the tokenizer ...
    init(*args)
    (root / f"start-{os.getpid()}").write_text(str(status("VmRSS")))


def encode_measured(payload):  # ... and its peak after every chunk
    out = encode(payload)
    (root / f"peak-{os.getpid()}").write_text(str(status("VmHWM")))
    return out


pool._init_worker, pool._encode_in_worker = init_measured, encode_measured
stream.CHUNK_BYTES = 1 << 16
cfg = types.SimpleNamespace(
    source="jsonl", paths=[str(root / "big.jsonl")], text_field="text",
    tokenizer=str(root / "tokenizer.json"), eos_token="<|endoftext|>", seq_len=64,
    val_fraction=0.05, max_corpus_mb=0.0, cache_dir=str(root / "cache"), workers=2, blend=[],
)
before = status("VmRSS")
bundle = build_data(cfg, 4096)
workers = [int((root / f"peak-{p.name[6:]}").read_text()) - int(p.read_text())
           for p in root.glob("start-*")]
print(json.dumps({
    "growth": status("VmHWM") - before,
    "worker_growth": workers,
    "corpus": (root / "big.jsonl").stat().st_size,
    "tokens": len(bundle.train) + len(bundle.val),
}))
"""


def test_a_corpus_larger_than_the_memory_it_may_use(tmp_path):
    """Built in a fresh process: its peak resident memory (VmHWM) may exceed what it held
    before the build by a quarter of the corpus at most, and so may each tokenizer worker's
    over its own start. Reading the corpus whole (the old build) would add at least the
    corpus itself, plus its tokens."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RSS_SCRIPT), str(tmp_path), str(CORPUS_MB)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    corpus_mb = m["corpus"] / 1e6
    assert corpus_mb >= CORPUS_MB and m["tokens"] > 6_000_000  # ~1,500 words per 9 KB line
    growth = m["growth"] / 1e6
    assert growth < ALLOWED_GROWTH_MB, (
        f"build grew by {growth:.1f} MB for a {corpus_mb:.0f} MB corpus"
    )
    assert len(m["worker_growth"]) == 2
    for g in m["worker_growth"]:
        assert g / 1e6 < ALLOWED_GROWTH_MB, f"a worker grew by {g / 1e6:.1f} MB"
