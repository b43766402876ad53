"""Hostile inputs: every config key and every input file, each bad value answered in one line.

The config half runs in-process over every key of `JobConfig` (enumerated with
`dataclasses.fields`, so a new key is covered the day it is added): wrong types, NaN and
infinities, numbers beyond 64 bits, negatives and huge values, from the command line (strings)
and from TOML (typed values). Each must either build a job or raise `ConfigError` naming the
key, never another exception. The keys run twice, on the default llama job and on the MoE
preset, so each family's checks see them.

The file half gives the CLI input files that are empty, truncated, binary, of the wrong JSON
type or a directory where a file belongs (the tests run as root, where chmod 000 does not stop
a read): each ends with exit status 2, one error line naming the file, no traceback, and a run
directory given to the command unchanged (every file's hash before = after).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import typing
from pathlib import Path

import pytest

from hyperloom.config import ConfigError, JobConfig, config_from_dict, load_config

# ----------------------------------------------------------------------------- config keys

BASES = {"llama": [], "deepseek": ["--model.preset", "moe-tiny"]}


def _keys() -> list[tuple[str, str, typing.Any, dataclasses.Field]]:
    out = []
    for section in dataclasses.fields(JobConfig):
        cls = typing.get_type_hints(JobConfig)[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append((section.name, f.name, hints[f.name], f))
    return out


KEYS = _keys()
KEY_IDS = [f"{s}.{n}" for s, n, _, _ in KEYS]
NUMERIC = [k for k in KEYS if k[2] in (int, float)]
NUMERIC_IDS = [f"{s}.{n}" for s, n, _, _ in NUMERIC]

# Keys for which a negative number means something (every other numeric key must refuse one).
NEGATIVE_OK = {"train.seed": "any integer seeds torch's generators"}

# Values of the wrong type, as the command line gives them (strings) and as TOML does.
WRONG_CLI = {
    int: ["abc", "1.5", "nan", "inf", "", "1e3", "true", "0x10"],
    float: ["abc", "", "1,5", "true", "--"],
    bool: ["maybe", "2", "", "nan"],
    str: [],  # any string is a string; its meaning is checked below
    list: ["[a", "[1, [2]]"],
}
WRONG_TOML = {
    int: [1.5, "3", True, [1], {"a": 1}, math.nan],
    float: ["1.0", True, [1.0], {"a": 1.0}],
    bool: [1, "true", [True], 0.0],
    str: [1, True, [], {"a": "b"}, 1.5],
    list: ["abc", 1, {"a": 1}],
}


def _kind(typ: typing.Any) -> type:
    return list if typing.get_origin(typ) in (list, tuple) else typ


def _problems(base: str, overrides: list[str]) -> list[str] | None:
    """The job's problems (None when it builds); any other exception fails the test."""
    try:
        load_config(None, BASES[base] + overrides, world_size=1)
    except ConfigError as exc:
        return exc.problems
    return None


def _toml_problems(base: str, section: str, name: str, value: typing.Any) -> list[str] | None:
    raw: dict = {"model": {"preset": "moe-tiny"}} if base == "deepseek" else {}
    raw.setdefault(section, {})[name] = value
    try:
        config_from_dict(raw, world_size=1)
    except ConfigError as exc:
        return exc.problems
    return None


def _names(problems: list[str], key: str) -> bool:
    """A problem names `key`: dotted, or in the arithmetic of a layout ("dp(3) * tp(2) ...")."""
    short = key.split(".", 1)[1]
    return any(key in p or f"{short}(" in p for p in problems)


def _assert_names(problems: list[str] | None, key: str, value: typing.Any) -> None:
    assert problems is not None, f"{key} = {value!r} was accepted"
    assert _names(problems, key), f"{key} = {value!r}: no problem names it: {problems}"


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("section,name,typ,field", KEYS, ids=KEY_IDS)
def test_a_value_of_the_wrong_type_names_its_key(section, name, typ, field, base):
    key = f"{section}.{name}"
    for value in WRONG_CLI[_kind(typ)]:
        _assert_names(_problems(base, [f"--{key}", value]), key, value)
    for value in WRONG_TOML[_kind(typ)]:
        _assert_names(_toml_problems(base, section, name, value), key, value)


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("section,name,typ,field", NUMERIC, ids=NUMERIC_IDS)
def test_nan_infinity_and_numbers_beyond_64_bits_name_their_key(section, name, typ, field, base):
    key = f"{section}.{name}"
    bad_cli = ["nan", "-nan", "-inf", "-1e999"]
    bad_toml: list[typing.Any] = [math.nan, -math.inf, -(10**400)]
    if typ is int:
        bad_cli += [str(2**63), str(-(2**63) - 1)]
        bad_toml += [2**63, -(2**63) - 1]
    if typ is int or not field.metadata.get("inf_ok"):
        bad_cli += ["inf", "1e999", "9" * 400]
        bad_toml += [math.inf, 10**400]
    for value in bad_cli:
        _assert_names(_problems(base, [f"--{key}", value]), key, value)
    for value in bad_toml:
        _assert_names(_toml_problems(base, section, name, value), key, value)


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("section,name,typ,field", NUMERIC, ids=NUMERIC_IDS)
def test_a_negative_number_names_its_key_unless_it_means_something(section, name, typ, field, base):
    key = f"{section}.{name}"
    for value in ("-1", "-3", "-1e30" if typ is float else str(-(2**62))):
        problems = _problems(base, [f"--{key}", value])
        if key in NEGATIVE_OK:
            assert problems is None or _names(problems, key)
        else:
            _assert_names(problems, key, value)


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("section,name,typ,field", KEYS, ids=KEY_IDS)
def test_odd_values_build_a_job_or_name_their_key(section, name, typ, field, base):
    """Zero, huge in-range numbers and odd strings: accepted or refused, never a crash."""
    key = f"{section}.{name}"
    values = {
        int: ["0", str(2**62), str(2**63 - 1), "1_000"],
        float: ["0", "1e300", "-0.0", "5e-324", "1e-300"],
        bool: ["TRUE", "off"],
        str: ["", " ", "\x00", "é" * 5000, "../../etc", "nan"],
        list: ["", ",", "[]", '[""]', "a,,b"],
    }[_kind(typ)]
    for value in values:
        problems = _problems(base, [f"--{key}", value])
        if problems is not None and not _names(problems, key):
            # refused for a reason of another key: only the baseline's own, never this one's
            assert problems == _problems(base, []), (key, value, problems)


def test_the_bases_are_valid_jobs():
    for base in BASES:
        assert _problems(base, []) is None


def test_one_problem_is_one_line():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--train.lr", "inf"], world_size=1)
    assert str(info.value) == "invalid configuration: train.lr must be finite, got inf"


# ----------------------------------------------------------------------------- files


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file under `root` (relative path -> SHA-256), and every directory (-> 'dir')."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def run_main(capsys):
    """`hyperloom ARGV` in this process -> (exit status, stderr); a traceback escapes as the
    exception itself. The root logger, which the CLI configures, is restored afterwards."""
    import logging

    from hyperloom.cli import main

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)

    def run(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        try:
            rc = main(list(argv))
        finally:
            root.handlers[:], root.level = saved
        return rc, capsys.readouterr().err

    return run


def assert_one_line_error(rc: int, stderr: str, *names: str) -> str:
    """Exit status 2, no traceback, and one error line, the last, naming one of `names`."""
    assert rc == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert any(str(n) in errors[0] for n in names), (names, errors[0])
    return errors[0]


def damage(path: Path, how: str) -> None:
    """Make `path` empty, truncated, binary, a JSON list, or a directory."""
    data = path.read_bytes() if path.is_file() else b"x = 1\n" * 40
    if path.is_file():
        path.unlink()
    if how == "dir":
        path.mkdir()
        return
    path.write_bytes(
        {
            "empty": b"",
            "truncated": data[: max(1, len(data) // 2)],
            "binary": bytes(range(256)) * 4,
            "json-list": b"[1, 2, 3]\n",
        }[how]
    )


HOW = ["empty", "truncated", "binary", "json-list", "dir"]
TINY = [
    "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
    "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "512",
    "--model.max_seq_len", "64", "--data.seq_len", "32", "--train.device", "cpu",
    "--precision.dtype", "fp32", "--train.host_allocator", "system",
    "--logging.progress", "false", "--logging.self_check", "off",
]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small JSONL corpus and the tokenizer trained on it."""
    from hyperloom.data import Document
    from hyperloom.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("corpus")
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20 for i in range(40)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = train_bpe([Document(str(i), t) for i, t in enumerate(texts)], 512, "<|endoftext|>")
    tok.save(root / "tokenizer.json")
    return root


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus) -> Path:
    """A run directory with one committed checkpoint of the tiny model (weights untrained)."""
    from hyperloom import checkpoint as ckpt
    from hyperloom.config import dumps_toml
    from hyperloom.data import Tokenizer
    from hyperloom.models.registry import init_model

    run = tmp_path_factory.mktemp("trained") / "run"
    job = load_config(None, TINY + ["--logging.run_dir", str(run)], world_size=1)
    state = init_model(job.model, "cpu", seed=0).state_dict()
    files = {
        "config.toml": dumps_toml(job),
        "tokenizer.json": Tokenizer.load(corpus / "tokenizer.json").to_json(),
    }
    ckpt.save_checkpoint(run, 1, state, {"step": 1}, files, {}, keep=1)
    return run


@pytest.fixture
def run_copy(trained_run, tmp_path) -> tuple[Path, dict[str, str]]:
    """A copy of the trained run for a command that must leave it as it was, and its hashes."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    return run, tree_hashes(run)


@pytest.mark.parametrize("how", HOW + ["not-utf8", "wrong-type", "nan"])
def test_a_bad_config_file_is_one_line_and_the_run_dir_is_untouched(
    how, tmp_path, run_main, run_copy
):
    run, before = run_copy
    path = tmp_path / "job.toml"
    if how == "not-utf8":
        path.write_bytes(b"[train]\nsteps = 3 # \xff\xfe\n")
    elif how == "wrong-type":
        path.write_text("train = 5\n")
    elif how == "nan":
        path.write_text("[train]\nlr = nan\n")
    else:
        path.write_text("[train]\nsteps = 3\nlr = 0.001\n")
        damage(path, how)
    if how == "empty":  # an empty TOML file is the default job
        assert run_main("config", "show", str(path), *TINY)[0] == 0
        return
    for command in ("train", "config show"):
        rc, err = run_main(*command.split(), str(path), *TINY, "--run-dir", str(run))
        assert_one_line_error(rc, err, path, "train.lr", "'train'")
    assert tree_hashes(run) == before


@pytest.mark.parametrize("how", HOW)
def test_a_bad_jsonl_file_is_one_line_and_the_run_dir_is_untouched(
    how, tmp_path, run_main, run_copy, corpus
):
    run, before = run_copy
    data = tmp_path / "data"
    data.mkdir()
    (data / "docs.jsonl").write_bytes((corpus / "docs.jsonl").read_bytes())
    damage(data / "docs.jsonl", how)
    rc, err = run_main(
        "train", *TINY, "--data.source", "jsonl", "--data.paths", str(data),
        "--data.tokenizer", str(corpus / "tokenizer.json"), "--run-dir", str(run),
    )  # fmt: skip
    assert_one_line_error(rc, err, data / "docs.jsonl", data)
    assert tree_hashes(run) == before


@pytest.mark.parametrize("how", HOW)
def test_a_bad_tokenizer_file_is_one_line_and_the_run_dir_is_untouched(
    how, tmp_path, run_main, run_copy, corpus
):
    run, before = run_copy
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes((corpus / "tokenizer.json").read_bytes())
    damage(tok, how)
    rc, err = run_main(
        "train", *TINY, "--data.source", "jsonl", "--data.paths", str(corpus / "docs.jsonl"),
        "--data.tokenizer", str(tok), "--run-dir", str(run),
    )  # fmt: skip
    assert_one_line_error(rc, err, tok)
    assert tree_hashes(run) == before


CHECKPOINT_FILES = ["model.safetensors", "meta.json", "config.toml", "tokenizer.json"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_generate_from_a_damaged_checkpoint_is_one_line_and_changes_nothing(
    name, how, run_main, run_copy
):
    run, before = run_copy
    (step,) = (run / "checkpoints").iterdir()
    damage(step / name, how)
    changed = tree_hashes(run)
    rc, err = run_main("generate", "--checkpoint", str(run), "--prompt", "def", "--device", "cpu")
    assert_one_line_error(rc, err, name, step.name, run)
    assert tree_hashes(run) == changed != before


def test_generate_from_a_checkpoint_whose_config_is_not_a_job(run_main, run_copy):
    """A config.toml that matches its hash but not the config schema names the file."""
    from hyperloom.checkpoint.commit import hash_files

    run, _ = run_copy
    (step,) = (run / "checkpoints").iterdir()
    text = (step / "config.toml").read_text()
    text = re.sub(r"^lr = 0.003", "lr = nan", text, flags=re.M)
    text = re.sub(r"^dp = 1\b", "dp = 4", text, flags=re.M)  # inference ignores the layout
    (step / "config.toml").write_text(text)
    meta = json.loads((step / "meta.json").read_text())
    meta["sha256"]["config.toml"] = hash_files(step, "config.toml")["config.toml"]
    (step / "meta.json").write_text(json.dumps(meta))
    rc, err = run_main("generate", "--checkpoint", str(run), "--prompt", "def", "--device", "cpu")
    line = assert_one_line_error(rc, err, "config.toml")
    assert "train.lr must be a number, got nan" in line


@pytest.fixture(scope="module")
def hf_dir(trained_run, tmp_path_factory) -> Path:
    from hyperloom.checkpoint.hf import export_hf

    return export_hf(trained_run, tmp_path_factory.mktemp("hf") / "model")


@pytest.mark.parametrize(
    "name,how",
    [("config.json", h) for h in HOW]
    + [("model.safetensors", h) for h in HOW]
    + [("model.safetensors.index.json", h) for h in ("truncated", "json-list", "binary")],
)
def test_convert_import_of_a_damaged_directory_is_one_line_and_writes_nothing(
    name, how, hf_dir, tmp_path, run_main
):
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    if name.endswith("index.json"):
        (src / name).write_text(json.dumps({"weight_map": {"x": "model.safetensors"}}))
    damage(src / name, how)
    rc, err = run_main("convert", "import", str(src), str(tmp_path / "out"))
    assert_one_line_error(rc, err, src / name, src)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attention_bias": True}, "attention_bias = true"),
        ({"hidden_size": "wide"}, "hidden_size"),
        ({"num_attention_heads": None}, "num_attention_heads"),
        ({"model_type": ["llama"]}, "model_type ['llama'] is not supported"),
        ({"num_hidden_layers": 3}, "weights do not fit"),
    ],
)
def test_convert_import_of_a_config_json_it_cannot_use(change, message, hf_dir, tmp_path, run_main):
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    raw = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**raw, **change}))
    rc, err = run_main("convert", "import", str(src), str(tmp_path / "out"))
    assert message in assert_one_line_error(rc, err, src)
    assert not (tmp_path / "out").exists()


def test_convert_import_of_weights_with_a_tensor_it_has_no_name_for(hf_dir, tmp_path, run_main):
    """A bias the model does not have (the issue's KeyError) is named, not raised."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(weights, str(src / "model.safetensors"))
    rc, err = run_main("convert", "import", str(src), str(tmp_path / "out"))
    assert "o_proj.bias" in assert_one_line_error(rc, err, src)


def test_a_save_uses_no_fixed_scratch_name_in_the_run_dir(tmp_path, run_main, corpus):
    """Two jobs in one run directory (orphaned workers and a relaunch) crashed on the
    trainer's fixed `.tokenizer.json` scratch file; a checkpoint takes the bytes instead."""
    run = tmp_path / "run"
    (run / ".tokenizer.json").mkdir(parents=True)  # what the other job's file would collide with
    rc, err = run_main(
        "train", *TINY, "--data.source", "jsonl", "--data.paths", str(corpus / "docs.jsonl"),
        "--data.tokenizer", str(corpus / "tokenizer.json"), "--data.val_fraction", "0.2",
        "--train.steps", "2", "--train.micro_batch_size", "2", "--train.eval_batches", "1",
        "--logging.plot", "false", "--logging.sample_tokens", "0", "--logging.peak_tflops", "1",
        "--run-dir", str(run),
    )  # fmt: skip
    assert rc == 0, err
    saved = run / "checkpoints" / "step_00000002" / "tokenizer.json"
    assert saved.read_bytes() == (corpus / "tokenizer.json").read_bytes()


# ----------------------------------------------------------------------------- the real CLI


def test_the_cli_answers_bad_input_with_one_line_and_exit_status_2(tmp_path, trained_run, cli):
    """A handful of `python -m hyperloom` runs, where the exit status is the point."""
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "latin1.toml").write_bytes(b"[train]\nsteps = 3  # \xe9t\xe9\n")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("[1, 2]")
    run = str(trained_run)
    cases = {
        ("train", *TINY, "--run-dir", run, "--train.lr", "inf"): "train.lr must be finite",
        ("train", *TINY, "--run-dir", run, "--train.lr", "nan"): "train.lr must be a number",
        ("config", "show", str(tmp_path / "latin1.toml")): "latin1.toml' is not UTF-8",
        ("train", *TINY, "--run-dir", run, "--nproc", "0"): "--nproc must be >= 1",
        ("train", *TINY, "--run-dir", run, "--max-restarts", "-1"): "--max-restarts must be",
        ("generate", "--checkpoint", run, "--prompt", "x", "--top-p", "0"): "--top-p must lie",
        ("generate", "--checkpoint", run, "--prompt", "x", "--top-k", "-3"): "--top-k must be",
        ("convert", "import", str(tmp_path / "hf"), str(tmp_path / "out")): "holds a JSON list",
    }
    before = tree_hashes(trained_run)
    with ThreadPoolExecutor(max_workers=2) as pool:  # the test machine has two cores
        results = dict(zip(cases, pool.map(lambda argv: cli(*argv), cases), strict=True))
    for argv, message in cases.items():
        result = results[argv]
        assert result.returncode == 2, (argv, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (argv, result.stderr)
    assert tree_hashes(trained_run) == before
    assert not (tmp_path / "out").exists()
