"""Tests for weighted blends: the `[[data.blend]]` config, Megatron's blending rule, the
loader's draws and their resumption, the packed segments, and a training run on a blend of
a Parquet file and a JSONL file that logs and records its mix.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_data_sources import make_cfg  # tests/unit is on sys.path under pytest

from hyperloom.config import ConfigError, dumps_toml, load_config
from hyperloom.config.data import BlendSource
from hyperloom.data import DataError, ResumableLoader, TokenDataset, build_data, val_batches
from hyperloom.data.blend import BlendSampler, Segment, blend_counts, pick
from hyperloom.train.trainer import Trainer

VOCAB = 512
EOS = "<|endoftext|>"


# --- config ------------------------------------------------------------------------------------

BLEND_TOML = """
[data]
source = "blend"

[[data.blend]]
source = "parquet"
paths = ["{parquet}"]
text_field = "content"
weight = 3

[[data.blend]]
source = "jsonl"
paths = ["{jsonl}"]
weight = 1
name = "web"
"""


def test_blend_tables_from_toml_and_cli_round_trip(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(BLEND_TOML.format(parquet="a.parquet", jsonl="b.jsonl"))
    cfg = load_config(path, [], world_size=1)
    first, second = cfg.data.blend
    assert (first.source, first.paths, first.text_field, first.weight) == (
        "parquet", ["a.parquet"], "content", 3.0
    )  # fmt: skip
    assert (second.source, second.text_field, second.name) == ("jsonl", "text", "web")
    again = tmp_path / "resolved.toml"
    again.write_text(dumps_toml(cfg))
    assert load_config(again, [], world_size=1) == cfg
    cli = load_config(
        None,
        ["--data.source", "blend", "--data.blend",
         '[{source = "parquet", paths = ["a.parquet"], text_field = "content", weight = 3}, '
         '{source = "jsonl", paths = ["b.jsonl"], weight = 1, name = "web"}]'],
        world_size=1,
    )  # fmt: skip
    assert cli.data == cfg.data


@pytest.mark.parametrize(
    "overrides,message",
    [
        (['[{sorce = "jsonl", paths = ["a"]}]'], r"unknown key 'data.blend\[0\].sorce' \(did you mean 'data.blend\[0\].source'\?\)"),
        (['[{source = "jsonl", paths = ["a"]}, {source = "csv", paths = ["b"]}]'], r"data.blend\[1\].source = 'csv' is not one of"),
        (['[{source = "jsonl", paths = ["a"], weight = 0}]'], r"data.blend\[0\].weight must be positive, got 0.0"),
        (['[{source = "jsonl", paths = ["a"], weight = nan}]'], r"data.blend\[0\].weight must be a number"),
        (['[{source = "jsonl"}]'], r"data.blend\[0\].paths is empty; source 'jsonl' needs files"),
        (['[{source = "megatron", paths = ["m"]}]'], r"data.blend\[0\] is a megatron dataset of token ids; set data.tokenizer"),
        (['["a.jsonl"]'], r"data.blend\[0\]: expected a table \{key = value, ...\}, got 'a.jsonl'"),
        ([], r"data.source = 'blend' needs \[\[data.blend\]\] tables"),
    ],
    ids=["misspelt-key", "bad-source", "zero-weight", "nan-weight", "no-paths", "megatron",
         "not-a-table", "no-entries"],
)  # fmt: skip
def test_bad_blend_entries_are_named(overrides, message):
    args = ["--data.source", "blend"] + (["--data.blend", *overrides] if overrides else [])
    with pytest.raises(ConfigError, match=message):
        load_config(None, args, world_size=1)


def test_blend_entries_need_source_blend_and_no_paths():
    entry = '[{source = "jsonl", paths = ["a.jsonl"]}]'
    with pytest.raises(ConfigError, match=r"data.blend is only used with data.source = 'blend'"):
        load_config(None, ["--data.blend", entry], world_size=1)
    with pytest.raises(ConfigError, match=r"data.paths is not used with data.source = 'blend'"):
        load_config(
            None,
            ["--data.source", "blend", "--data.blend", entry, "--data.paths", "x"],
            world_size=1,
        )


# --- Megatron's rule ---------------------------------------------------------------------------


def test_rule_by_hand_and_its_bound():
    """0.7 / 0.3: the deficits worked by hand give 0,1,0,0,1,0,0,1,0,0; for random weights
    the realised counts never stray two sequences from w_s * k."""
    counts, order = [0, 0], []
    for k in range(10):
        s = pick([0.7, 0.3], counts, k)
        order.append(s)
        counts[s] += 1
    assert order == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    rng = random.Random(0)
    for _ in range(50):
        w = [rng.random() ** 3 + 1e-3 for _ in range(rng.randint(2, 6))]
        w = [x / sum(w) for x in w]
        counts = [0] * len(w)
        for k in range(2000):
            counts[pick(w, counts, k)] += 1
            assert max(abs(c - ws * (k + 1)) for c, ws in zip(counts, w, strict=True)) < 2
    assert blend_counts([0.5, 0.0, 0.5], 9) == [5, 0, 4]  # weight 0: never drawn


def blend_dataset() -> TokenDataset:
    """Three segments of distinct token ranges: 0-80 (10 windows of 8), 1000-1040 (5) and
    2000-2200 (25), weighted 2 : 1 : 1."""
    parts = [np.arange(0, 81), np.arange(1000, 1041), np.arange(2000, 2201)]
    tokens = np.concatenate(parts).astype(np.uint16)
    bounds = np.cumsum([0] + [len(p) for p in parts])
    segs = [
        Segment(n, int(a), int(b), w)
        for n, a, b, w in zip("abc", bounds[:-1], bounds[1:], (2, 1, 1), strict=True)
    ]
    return TokenDataset(tokens, "train", segs)


def test_windows_stay_inside_their_source_and_follow_the_weights():
    ds = blend_dataset()
    assert ds.num_sequences(8) == 10 + 5 + 25
    loader = ResumableLoader(ds, batch_size=8, seq_len=8, seed=5)
    firsts = torch.cat([loader.next_batch()[0][:, 0] for _ in range(10)])  # 80 draws
    source = (firsts // 1000).tolist()
    assert [source.count(s) for s in range(3)] == [40, 20, 20]
    x, y = loader.next_batch()
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert ((x // 1000) == (y // 1000)).all()  # no window crosses a segment's end
    # Source a (10 windows) was drawn 40 times: 4 epochs, each a permutation of its windows.
    a = firsts[firsts < 1000].tolist()
    assert all(sorted(a[i : i + 10]) == list(range(0, 80, 8)) for i in range(0, 40, 10))
    assert a[:10] != a[10:20]


@pytest.mark.parametrize("k", [1, 4, 7])
def test_blend_loader_resumes_exactly(k):
    ds = blend_dataset()
    ref = ResumableLoader(ds, batch_size=3, seq_len=8, seed=11)
    expected = [ref.next_batch()[0] for _ in range(12)]
    first = ResumableLoader(ds, batch_size=3, seq_len=8, seed=11)
    for _ in range(k):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = ResumableLoader(ds, batch_size=3, seq_len=8, seed=11)
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.next_batch()[0], x) for x in expected[k:])
    assert resumed.state_dict() == ref.state_dict()


def test_blend_state_from_other_sources_is_refused_and_new_weights_warned(caplog):
    ds = blend_dataset()
    state = ResumableLoader(ds, 3, 8, seed=1).state_dict()
    plain = TokenDataset(np.arange(len(ds), dtype=np.uint16))
    with pytest.raises(DataError, match=r"loader state has no blend counts"):
        ResumableLoader(ds, 3, 8, seed=1).load_state_dict(
            {**ResumableLoader(plain, 3, 8, seed=1).state_dict(), "num_sequences": 40}
        )
    other = TokenDataset(ds.tokens, "train", [Segment("a", 0, 121, 1), Segment("b", 121, 323, 1)])
    with pytest.raises(
        DataError, match=r"sources of \[10, 5, 25\] sequences, this blend \[15, 25\]"
    ):
        ResumableLoader(other, 3, 8, seed=1).load_state_dict(state)
    reweighted = TokenDataset(
        ds.tokens, "train", [Segment(s.name, s.start, s.stop, 1) for s in ds.segments]
    )
    with caplog.at_level(logging.WARNING, logger="hyperloom.data"):
        ResumableLoader(reweighted, 3, 8, seed=1).load_state_dict(state)
    assert "blend weights changed" in caplog.text


def test_blend_val_batches_follow_the_mix_in_order():
    ds = blend_dataset()
    batches = val_batches(ds, batch_size=4, seq_len=8, n_batches=3)
    firsts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    expected, counts = [], [0, 0, 0]
    for k in range(12):
        s = pick([0.5, 0.25, 0.25], counts, k)
        expected.append((0, 1000, 2000)[s] + 8 * counts[s])  # each source's windows in order
        counts[s] += 1
    assert firsts == expected


def test_plan_counts_epochs_and_fractions():
    sampler = BlendSampler(blend_dataset().segments, seq_len=8, seed=0, shuffle=True)
    plan = sampler.plan(400)
    assert [r["drawn"] for r in plan.values()] == [200, 100, 100]
    assert plan["a"]["epochs"] == pytest.approx(20.0) and plan["c"]["epochs"] == pytest.approx(4.0)
    assert plan["b"]["fraction"] == pytest.approx(0.25) and plan["a"]["tokens"] == 81


# --- building a blend and training on it -------------------------------------------------------


def write_parquet_and_jsonl(root: Path) -> tuple[Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    pq_path, jl_path = root / "books.parquet", root / "web.jsonl"
    books = [f"chapter {i} " + "alpha beta gamma delta " * (30 + i % 9) for i in range(120)]
    pq.write_table(pa.table({"content": books}), pq_path, row_group_size=40)
    with open(jl_path, "w") as fh:
        for i in range(80):
            fh.write(json.dumps({"text": f"page {i} " + "omega sigma tau " * (25 + i % 7)}) + "\n")
    return pq_path, jl_path


def blend_cfg(tmp: Path, pq_path: Path, jl_path: Path, weights=(3.0, 1.0), **kw):
    blend = [
        BlendSource("parquet", [str(pq_path)], text_field="content", weight=weights[0]),
        BlendSource("jsonl", [str(jl_path)], weight=weights[1], name="web"),
    ]
    return make_cfg(
        tmp, **{"source": "blend", "blend": blend, "seq_len": 32, "val_fraction": 0.1, **kw}
    )


def test_a_blend_packs_each_source_as_it_would_alone(tmp_path):
    pq_path, jl_path = write_parquet_and_jsonl(tmp_path / "corpus")
    b = build_data(blend_cfg(tmp_path, pq_path, jl_path), VOCAB)
    tok_file = tmp_path / "tokenizer.json"
    b.tokenizer.save(tok_file)
    segs = b.train.segments
    assert [s.name for s in segs] == ["parquet:books.parquet", "web"]
    assert [s.weight for s in segs] == [3.0, 1.0]
    assert segs[0].start == 0 and segs[0].stop == segs[1].start and segs[1].stop == len(b.train)
    assert [r["documents"] for r in b.corpus_info["sources"]] == [120, 80]
    # Each segment is exactly that source built on its own with the same tokenizer.
    for i, (src, path, field) in enumerate(
        [("parquet", pq_path, "content"), ("jsonl", jl_path, "text")]
    ):
        alone = build_data(
            blend_cfg(tmp_path, pq_path, jl_path, source=src, paths=[str(path)], text_field=field,
                      blend=[], tokenizer=str(tok_file)),
            VOCAB,
        )  # fmt: skip
        for split in ("train", "val"):
            seg = getattr(b, split).segments[i]
            part = np.asarray(getattr(b, split).tokens)[seg.start : seg.stop]
            assert np.array_equal(part, getattr(alone, split).tokens), (src, split)
    # Weights only steer the loader: a new mix reuses the same cache.
    again = build_data(blend_cfg(tmp_path, pq_path, jl_path, weights=(1.0, 1.0)), VOCAB)
    assert (
        again.corpus_info["cache_hit"]
        and again.corpus_info["cache_dir"] == b.corpus_info["cache_dir"]
    )
    assert [s.weight for s in again.train.segments] == [1.0, 1.0]


def test_a_blend_source_too_small_for_seq_len_is_named(tmp_path):
    pq_path, jl_path = write_parquet_and_jsonl(tmp_path / "corpus")
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "one two"}) + "\n" + json.dumps({"text": "three"}) + "\n")
    cfg = blend_cfg(tmp_path, pq_path, tiny)
    with pytest.raises(
        DataError, match=r"larger than blend source 'web' can fill: its train split has \d+ tokens"
    ):
        build_data(cfg, VOCAB)


def test_a_blend_of_parquet_and_jsonl_trains_with_the_logged_mix(tmp_path, tiny_job_args, caplog):
    """The acceptance run: the mix is logged at the start, recorded in metrics.jsonl and in
    summary.json, and what was drawn is that mix."""
    pq_path, jl_path = write_parquet_and_jsonl(tmp_path / "corpus")
    toml = tmp_path / "job.toml"
    toml.write_text(BLEND_TOML.format(parquet=pq_path, jsonl=jl_path))
    run = tmp_path / "run"
    cfg = load_config(
        toml, tiny_job_args(run, train__steps=10, data__seq_len=32, data__max_corpus_mb=0)
    )
    with caplog.at_level(logging.INFO, logger="hyperloom.train"):
        summary = Trainer(cfg).run().summary
    assert "data mix (planned for 10 steps)" in caplog.text
    assert (
        "parquet:books.parquet: weight 0.750" in caplog.text and "web: weight 0.250" in caplog.text
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    planned = next(r for r in records if r["event"] == "data_mix")["planned"]
    drawn = 10 * 4  # steps x micro_batch_size
    assert planned["parquet:books.parquet"]["drawn"] == 30 and planned["web"]["drawn"] == 10
    realised = json.loads((run / "summary.json").read_text())["data_mix"]
    assert realised == summary["data_mix"]
    assert {k: v["drawn"] for k, v in realised.items()} == {"parquet:books.parquet": 30, "web": 10}
    assert sum(v["drawn"] for v in realised.values()) == drawn
    assert realised["web"]["fraction"] == pytest.approx(0.25)
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def test_data_prepare_builds_the_blend_cache_that_training_then_finds(tmp_path, cli):
    pq_path, jl_path = write_parquet_and_jsonl(tmp_path / "corpus")
    toml = tmp_path / "job.toml"
    toml.write_text(BLEND_TOML.format(parquet=pq_path, jsonl=jl_path))
    args = ["--data.cache_dir", str(tmp_path / "cache"), "--logging.progress", "false"]
    result = cli("data", "prepare", str(toml), *args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "blend sources" in result.stdout and "built" in result.stdout
    assert "parquet:books.parquet" in result.stdout and "0.750" in result.stdout
    again = cli("data", "prepare", str(toml), *args)
    assert "no: found in the cache" in again.stdout
    missing = cli("data", "prepare", "--data.source", "parquet", "--data.paths", "nope.parquet")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "data path 'nope.parquet' does not exist" in missing.stderr
