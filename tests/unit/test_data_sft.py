"""Tests for data.source = "sft": chat templates, answer-only labels, packing, the cache, training.

Real templates (Llama-3's and Qwen2's ChatML, copied from their tokenizer_config.json) render
through a small byte-level BPE that has their special tokens; the learnt tokens must decode to
exactly each assistant answer and its end-of-turn token. Where transformers is installed, the
rendering and the `{% generation %}` mask are checked against `apply_chat_template` itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hyperloom.data.sft as sft_mod
from hyperloom.config import ConfigError, DataConfig, load_config
from hyperloom.data import DataError, Document, SFTLoader, Tokenizer, build_data, sft_val_batches
from hyperloom.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate, load_chat_template
from hyperloom.data.multimodal.dataset import IGNORE_INDEX
from hyperloom.data.sft_packing import SFTDataset, pack_best_fit
from hyperloom.data.tokenizer import train_bpe

LLAMA3 = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (  # Qwen/Qwen2-0.5B-Instruct
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_MARKED = (  # ChatML whose answers are marked, as transformers' tests write it
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = {  # template -> (special tokens, tokenizer_config's bos/eos, data.eos_token)
    "llama3": (
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "<|end_of_text|>",
    ),
    "chatml": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|im_end|>"},
        "<|endoftext|>",
    ),
}
TEMPLATES = {"llama3": (LLAMA3, "llama3"), "chatml": (CHATML, "chatml")}
TEMPLATES["chatml_marked"] = (CHATML_MARKED, "chatml")

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
]
ANSWERS = ["Paris.", "Rome, since 1871."]
END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>"}


def cfg_for(tmp: Path, paths: list[str], **overrides) -> DataConfig:
    """A data config for source sft, cached under `tmp`."""
    values = dict(source="sft", paths=paths, seq_len=64, val_fraction=0.2)
    return DataConfig(**{**values, "cache_dir": str(tmp / "cache"), **overrides})


def arithmetic(n: int, seed: int = 0) -> list[list[dict]]:
    """Conversations a tiny model can learn: `What is a plus b?` -> `a plus b is c.`"""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 30), rng.randint(0, 30)
        msgs = [{"role": "user", "content": f"What is {a} plus {b}?"}]
        msgs.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}."})
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "You add numbers."})
        out.append(msgs)
    return out


def write_jsonl(path: Path, convs: list, field: str = "messages") -> str:
    path.write_text("".join(json.dumps({field: c}) + "\n" for c in convs))
    return str(path)


@pytest.fixture(scope="module")
def base_bpe() -> Tokenizer:
    texts = [json.dumps(c) for c in arithmetic(200)] + [json.dumps(CONVERSATION)] * 20
    return train_bpe([Document(str(i), t) for i, t in enumerate(texts)], 400, "<|endoftext|>")


def hf_tokenizer_dir(root: Path, base: Tokenizer, template: str, family: str) -> Path:
    """A Hugging Face tokenizer folder: tokenizer.json with the family's special tokens and a
    tokenizer_config.json holding the chat template."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    specials, named, _ = SPECIALS[family]
    backend = HFTokenizer.from_str(base.backend.to_str())
    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    root.mkdir(parents=True, exist_ok=True)
    backend.save(str(root / "tokenizer.json"))
    config = {"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast", **named}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def answer_runs(tok: Tokenizer, ids: np.ndarray, learnt: np.ndarray) -> list[str]:
    """The decoded text of each maximal run of learnt tokens."""
    runs, start = [], None
    for i, flag in enumerate([*learnt.tolist(), False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append(tok.decode(ids[start:i].tolist()))
            start = None
    return runs


def sample(ds: SFTDataset, i: int) -> tuple[np.ndarray, np.ndarray]:
    s, e = ds.offsets[i], ds.offsets[i + 1]
    return np.asarray(ds.tokens[s:e]), np.asarray(ds.mask[s:e]).astype(bool)


def build_with_template(tmp: Path, base: Tokenizer, name: str, convs=None):
    template, family = TEMPLATES[name]
    folder = hf_tokenizer_dir(tmp / f"tok-{name}", base, template, family)
    paths = [write_jsonl(tmp / f"{name}.jsonl", convs or [CONVERSATION] * 4)]
    cfg = cfg_for(tmp, paths, tokenizer=str(folder), eos_token=SPECIALS[family][2], seq_len=256)
    return build_data(cfg, 512), folder


# --------------------------------------------------------------------------- templates, masks


@pytest.mark.parametrize("name", ["llama3", "chatml", "chatml_marked"])
def test_real_templates_learn_exactly_each_answer_and_its_end_of_turn(tmp_path, base_bpe, name):
    bundle, _ = build_with_template(tmp_path, base_bpe, name)
    family = TEMPLATES[name][1]
    ds, tok = bundle.train, bundle.tokenizer
    ids, learnt = sample(ds, 0)
    assert answer_runs(tok, ids, learnt) == [a + END_OF_TURN[family] for a in ANSWERS]
    # What the loss sees: a row's labels are exactly its conversations' answers.
    p = ds.packing(256)
    _, labels = ds.batch([0], 256)
    in_row = int(p.starts[1] - p.starts[0])
    learnt_text = tok.decode(labels[0][labels[0] != IGNORE_INDEX].tolist())
    assert learnt_text == "".join(a + END_OF_TURN[family] for a in ANSWERS) * in_row
    text = tok.decode(ids.tolist())
    if family == "llama3":
        assert text.startswith(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nParis.<|eot_id|>"
        )
        assert text.endswith("Rome, since 1871.<|eot_id|><|end_of_text|>")  # + the separator
    else:
        assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
        assert text.endswith("Rome, since 1871.<|im_end|>\n<|endoftext|>")


@pytest.mark.parametrize("name", ["llama3", "chatml", "chatml_marked"])
def test_rendering_and_marked_mask_match_transformers(tmp_path, base_bpe, name):
    transformers = pytest.importorskip("transformers")
    template, family = TEMPLATES[name]
    folder = hf_tokenizer_dir(tmp_path, base_bpe, template, family)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tpl = load_chat_template("", folder, SPECIALS[family][2])
    for gen in (False, True):
        ours = tpl.render(CONVERSATION[:4], add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(
            CONVERSATION[:4], tokenize=False, add_generation_prompt=gen
        )
    if name == "chatml_marked":
        out = hf.apply_chat_template(
            CONVERSATION, return_dict=True, return_assistant_tokens_mask=True
        )
        bundle, _ = build_with_template(tmp_path, base_bpe, name)
        ids, learnt = sample(bundle.train, 0)
        n = len(out["input_ids"])
        assert ids[:n].tolist() == list(out["input_ids"])
        assert learnt[:n].astype(int).tolist() == list(out["assistant_masks"])


def test_default_template_for_the_built_in_tokenizer(tmp_path):
    convs = arithmetic(40)
    cfg = cfg_for(tmp_path, [write_jsonl(tmp_path / "a.jsonl", convs)])
    bundle = build_data(cfg, 512)
    assert bundle.corpus_info["template"].startswith("built-in default")
    ds, tok = bundle.train, bundle.tokenizer
    wanted = {m["content"] + "<|endoftext|>" for c in convs for m in c if m["role"] == "assistant"}
    for i in range(len(ds)):
        ids, learnt = sample(ds, i)
        (run,) = answer_runs(tok, ids, learnt)
        assert run in wanted
        assert tok.decode(ids.tolist()).startswith(("<|user|>\nWhat is", "<|system|>\nYou add"))
        assert ids[-1] == tok.eos_id and ids[-2] != tok.eos_id  # the template's eos ends it
    tpl = ChatTemplate(DEFAULT_TEMPLATE, {"eos_token": "</s>"}, "test")
    assert tpl.render(convs[1], add_generation_prompt=False) == (
        f"<|user|>\n{convs[1][0]['content']}</s><|assistant|>\n{convs[1][1]['content']}</s>"
    )


def test_parquet_gives_the_same_samples_as_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    convs = arithmetic(30)
    jsonl = build_data(cfg_for(tmp_path, [write_jsonl(tmp_path / "c.jsonl", convs)]), 512)
    jsonl.tokenizer.save(tmp_path / "tokenizer.json")  # the same tokenizer for both
    pq.write_table(pa.table({"messages": convs}), tmp_path / "c.parquet")
    cfg = cfg_for(tmp_path, [str(tmp_path / "c.parquet")], tokenizer=str(tmp_path))
    parquet = build_data(cfg, 512)

    # The split hashes "c.jsonl#<line>" and "c.parquet#<row>": compare the samples as a set.
    def samples(b):
        return sorted(
            (tuple(t.tolist()), tuple(m.tolist()))
            for ds in (b.train, b.val)
            for t, m in (sample(ds, i) for i in range(len(ds)))
        )

    assert samples(parquet) == samples(jsonl)
    bad = cfg_for(tmp_path, [str(tmp_path / "c.parquet")], messages_field="chat", tokenizer="")
    with pytest.raises(DataError, match="no column 'chat'.*columns: messages"):
        build_data(bad, 512)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "hi"}, "line 1 .* lacks field 'messages'.*fields present: text"),
        ({"messages": "hi"}, "line 1 .*must be a non-empty list of messages"),
        ({"messages": [{"role": "user"}]}, "message 1 must be an object with 'role' and 'c"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "message 1 has role 'bot'; allowed"),
        ({"messages": [{"role": "user", "content": 3}]}, "content is a int, expected a string"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no 'assistant' message"),
    ],
)
def test_bad_records_name_the_line(tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps({"messages": CONVERSATION}) + "\n")
    with pytest.raises(DataError, match=message):
        build_data(cfg_for(tmp_path, [str(path)]), 512)


def test_bad_templates_are_one_line_errors(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [CONVERSATION] * 3)
    cases = {
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}": "JSONL line 1 .*failed on it: no system role",
        "{% for m in messages %}": "not valid Jinja",
        # Earlier turns rendered differently once a later one exists: not prefixes.
        "{% for m in messages %}{{ m['content'] if loop.last else m['role'] }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}": r"not render.*\{% generation %\}",
        "{{ strftime_now('%d') }}": "failed on it: 'strftime_now' is undefined",
    }
    for k, (source, message) in enumerate(cases.items()):
        (tmp_path / f"t{k}.jinja").write_text(source)
        cfg = cfg_for(tmp_path, [path], chat_template=str(tmp_path / f"t{k}.jinja"))
        with pytest.raises(DataError, match=message):
            build_data(cfg, 512)


def test_config_knobs_are_checked():
    with pytest.raises(ConfigError, match="data.source = 'sft' needs data.paths"):
        load_config(None, ["--data.source", "sft"])
    with pytest.raises(ConfigError, match="sft_overflow"):
        load_config(None, ["--data.source", "sft", "--data.paths", "x", "--data.sft_overflow", "x"])


# --------------------------------------------------------------------------- packing


def test_best_fit_decreasing_by_hand_and_its_invariants():
    # 6 opens row A (room 4), 5 opens B (room 5), 4 fills A, 3 -> B (room 2), 2 fills B.
    assert pack_best_fit([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=3000).tolist()
    rows = pack_best_fit(lengths, 256)
    assert sorted(i for r in rows for i in r) == list(range(3000))
    assert all(sum(lengths[i] for i in r) <= 256 for r in rows)
    assert len(rows) <= math.ceil(11 / 9 * math.ceil(sum(lengths) / 256)) + 1  # Johnson's bound
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)  # rows in file order


@pytest.fixture(scope="module")
def arith_bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arith")
    cfg = cfg_for(tmp, [write_jsonl(tmp / "a.jsonl", arithmetic(120))], seq_len=48)
    return cfg, build_data(cfg, 512)


def test_rows_hold_whole_samples_and_learn_each_answer_token_once(arith_bundle):
    cfg, bundle = arith_bundle
    ds = bundle.train
    p = ds.packing(cfg.seq_len)
    inputs, labels = ds.batch(np.arange(p.rows), cfg.seq_len)  # the whole epoch
    tokens, answer = ds.rows(np.arange(p.rows), cfg.seq_len)
    seen = []
    for r in range(p.rows):
        members = p.members[p.starts[r] : p.starts[r + 1]].tolist()
        seen += members
        whole = np.concatenate([sample(ds, i)[0] for i in members])
        assert tokens[r, : len(whole)].tolist() == whole.tolist()  # samples whole, in order
        assert (tokens[r, len(whole) :] == ds.pad_id).all() and not answer[r, len(whole) :].any()
    assert sorted(seen) == list(range(len(ds)))
    assert inputs.shape == labels.shape == (p.rows, cfg.seq_len)
    learnt = labels != IGNORE_INDEX
    assert torch.equal(learnt, torch.from_numpy(answer[:, 1:]))  # the next token is an answer
    assert torch.equal(labels[learnt], torch.from_numpy(tokens[:, 1:])[learnt])  # next tokens
    total = sum(int(sample(ds, i)[1][1:].sum()) for i in range(len(ds)))
    assert int(learnt.sum()) == total == p.labels == bundle.corpus_info["train_labels"]
    assert 0 < total < learnt.numel() / 2  # prompts and padding are not learnt


def test_long_samples_are_truncated_counted_dropped_or_refused(arith_bundle, caplog):
    cfg, bundle = arith_bundle
    ds = bundle.train
    seq_len = int(ds.lengths.max()) - 2  # the longest samples lose their last token
    over = int((ds.lengths > seq_len + 1).sum())
    assert 0 < over < len(ds)
    with caplog.at_level("WARNING", logger="hyperloom.data"):
        p = ds.packing(seq_len)
    assert p.truncated == over and f"{over} of {len(ds)} samples are longer" in caplog.text
    assert p.dropped == 0  # a cut of one token keeps the rest of the answer
    kept = sum(int(sample(ds, i)[1][1 : seq_len + 1].sum()) for i in range(len(ds)))
    _, labels = ds.batch(np.arange(p.rows), seq_len)
    assert int((labels != IGNORE_INDEX).sum()) == p.labels == kept < ds.packing(cfg.seq_len).labels
    # Cut before their answers: the samples with a system prompt are dropped, and counted.
    cut = int(np.median(ds.lengths)) - 1
    lost = [i for i in range(len(ds)) if not sample(ds, i)[1][1 : cut + 1].any()]
    assert 0 < len(lost) < len(ds)
    assert ds.packing(cut).dropped == len(lost) and ds.packing(cut).rows > 0
    with pytest.raises(DataError, match="every train sample loses all its answer tokens"):
        ds.packing(8)
    strict = SFTDataset(
        "train", ds.tokens, ds.mask, ds.lengths, pad_id=0, overflow="error", where=ds._where
    )
    with pytest.raises(DataError, match=r"JSONL line \d+ of file .*a row holds seq_len \+ 1"):
        strict.packing(seq_len)


# --------------------------------------------------------------------------- cache and loader


def test_the_cache_is_reused_rebuilt_when_damaged_and_keyed_by_the_template(
    arith_bundle, monkeypatch, caplog
):
    cfg, first = arith_bundle

    def forbidden(*args, **kwargs):
        raise AssertionError("a cached build must not render or tokenize again")

    monkeypatch.setattr(sft_mod, "encode_samples", forbidden)
    monkeypatch.setattr(sft_mod, "train_bpe", forbidden)
    again = build_data(cfg, 512)
    assert (
        again.corpus_info["cache_hit"]
        and again.corpus_info["cache_dir"] == (first.corpus_info["cache_dir"])
    )
    assert np.array_equal(again.train.mask, first.train.mask)
    # A truncated answer-flag file is found out and built again (with a warning).
    # (A new file renamed over it: the fixture's memory maps keep the old one.)
    mask_file = Path(first.corpus_info["cache_dir"]) / "train_mask.npy"
    damaged = mask_file.with_name("damaged.tmp")
    damaged.write_bytes(mask_file.read_bytes()[:-7])
    os.replace(damaged, mask_file)
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="hyperloom.data"):
        rebuilt = build_data(cfg, 512)
    assert "train_mask.npy" in caplog.text and not rebuilt.corpus_info["cache_hit"]
    assert np.array_equal(rebuilt.train.mask, first.train.mask)
    monkeypatch.setattr(sft_mod, "encode_samples", forbidden)
    template = Path(cfg.cache_dir).parent / "other.jinja"
    template.write_text(DEFAULT_TEMPLATE.replace("<|", "[["))
    with pytest.raises(AssertionError, match="must not render"):  # a new key: built again
        build_data(dataclasses.replace(cfg, chat_template=str(template)), 512)


def test_loader_resumes_exactly_and_val_batches_are_fixed(arith_bundle):
    cfg, bundle = arith_bundle
    loader = SFTLoader(bundle.train, 3, cfg.seq_len, seed=7)
    for _ in range(5):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(30)]  # crosses an epoch boundary
    resumed = SFTLoader(bundle.train, 3, cfg.seq_len, seed=7)
    resumed.load_state_dict(state)
    for (x, y), (x2, y2) in zip(expected, [resumed.next_batch() for _ in range(30)], strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(DataError, match="seed"):
        SFTLoader(bundle.train, 3, cfg.seq_len, seed=8).load_state_dict(state)
    val = sft_val_batches(bundle.val, 2, cfg.seq_len, 3)
    again = sft_val_batches(bundle.val, 2, cfg.seq_len, 3)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(val, again, strict=True))
    assert all((y != IGNORE_INDEX).any() for _, y in val)
    with pytest.raises(DataError, match="one batch needs batch_size = 999"):
        sft_val_batches(bundle.val, 999, cfg.seq_len, 1)


# --------------------------------------------------------------------------- training


def sft_job(tmp: Path, tiny_job_args, steps: int = 40) -> list[str]:
    path = write_jsonl(tmp / "train.jsonl", arithmetic(400))
    args = tiny_job_args(
        tmp / "run",
        data__source="sft",
        data__paths=path,
        data__max_corpus_mb=0,
        data__val_fraction=0.1,
        train__steps=steps,
        train__eval_every=steps // 2,
    )
    return args


def test_masked_loss_equals_a_hand_computation(tmp_path, tiny_job_args):
    from hyperloom.train.trainer import Trainer

    trainer = Trainer(load_config(None, sft_job(tmp_path, tiny_job_args, steps=1)))
    assert isinstance(trainer.loader, SFTLoader)
    inputs, labels = trainer.loader.next_batch()
    model = trainer.model
    with torch.no_grad():
        loss = model(inputs, labels=labels)
        logits = model(inputs).double()  # (batch, seq, vocab)
    learnt = labels != IGNORE_INDEX
    nll = -torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    hand = nll[learnt].sum() / learnt.sum()  # the mean over the answer tokens only
    assert loss.item() == pytest.approx(hand.item(), rel=1e-5)
    everything = F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs[:, 1:].flatten())
    assert abs(everything.item() - hand.item()) > 1e-3  # so the mask does change the loss
    # Validation: the same masked mean per fixed batch, averaged over the batches.
    with torch.no_grad():
        per_batch = []
        for x, y in trainer.val:
            lp = torch.log_softmax(model(x).double(), -1)
            keep = y != IGNORE_INDEX
            per_batch.append(-lp.gather(-1, y.clamp(min=0)[..., None])[..., 0][keep].mean())
    assert trainer.evaluate() == pytest.approx(torch.stack(per_batch).mean().item(), rel=1e-5)


def test_hyperloom_train_sft_lowers_the_answer_loss(tmp_path, tiny_job_args, cli):
    result = cli("train", *sft_job(tmp_path, tiny_job_args))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    evals = [r["val_loss"] for r in map(json.loads, lines) if r.get("event") == "eval"]
    assert len(evals) == 3
    assert evals[0] == pytest.approx(math.log(512), abs=0.1)  # untrained: uniform
    assert evals[-1] < evals[0] - 2.0  # the answers are learnt
