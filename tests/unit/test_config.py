"""Tests for hyperloom.config: malformed jobs fail with one clear message, good ones load.

Every malformed case is checked through `load_config` (a `ConfigError` whose text names the
problem) and a selection of them through `python -m hyperloom config show` (exit status 2,
the message on stderr, no traceback).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hyperloom.config import (
    ConfigError,
    JobConfig,
    config_from_dict,
    dumps_toml,
    load_config,
    parse_overrides,
    to_dict,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# --------------------------------------------------------------------------- malformed jobs

# name -> (TOML file text or None, overrides, expected message (a literal substring)).
BAD: dict[str, tuple[str | None, list[str], str]] = {
    "unknown_key": (
        None,
        ["--train.stpes", "10"],
        "unknown key 'train.stpes' (did you mean 'train.steps'?); [train] accepts: steps,",
    ),
    "unknown_key_toml": (
        "[model]\ndimm = 64\n",
        [],
        "unknown key 'model.dimm' (did you mean 'model.dim'?)",
    ),
    "unknown_section": (
        "[trian]\nsteps = 10\n",
        [],
        "unknown section '[trian]' (did you mean 'train'?); sections are: model, parallel,",
    ),
    "section_not_a_table": ("train = 3\n", [], "'train' must be a table ([train]), got 3"),
    "toml_string_for_int": (
        '[train]\nsteps = "ten"\n',
        [],
        "train.steps: expected an integer, got 'ten'",
    ),
    "toml_string_for_bool": (
        '[logging]\nplot = "true"\n',
        [],
        "logging.plot: expected true or false, got 'true'",
    ),
    "toml_float_for_int": ("[model]\ndim = 64.0\n", [], "model.dim: expected an integer, got 64.0"),
    "toml_string_for_list": (
        '[data]\nsource = "text"\npaths = "a.txt"\n',
        [],
        "data.paths: expected a list, got str 'a.txt'",
    ),
    "toml_list_item_type": (
        '[data]\nsource = "text"\npaths = ["a.txt", 3]\n',
        [],
        "data.paths[1]: expected a string, got 3",
    ),
    "cli_not_a_number": (None, ["--train.lr", "abc"], "train.lr: expected a number, got 'abc'"),
    "cli_not_an_int": (
        None,
        ["--train.steps", "1.5"],
        "train.steps: expected an integer, got '1.5'",
    ),
    "cli_bad_bool": (
        None,
        ["--logging.plot", "maybe"],
        "logging.plot: expected true or false, got 'maybe'",
    ),
    "not_a_choice": (
        None,
        ["--precision.dtype", "fp7"],
        "precision.dtype = 'fp7' is not one of: 'bf16', 'fp32'",
    ),
    "schedule_not_a_choice": (
        None,
        ["--train.schedule", "linear"],
        "train.schedule = 'linear' is not one of: 'cosine', 'wsd', 'constant'",
    ),
    "heads_do_not_divide_dim": (
        None,
        ["--model.dim", "100", "--model.n_heads", "3", "--model.n_kv_heads", "1"],
        "model.dim (100) is not divisible by model.n_heads (3): 100 / 3 = 33.33",
    ),
    "kv_heads_do_not_divide_heads": (
        None,
        ["--model.dim", "384", "--model.n_heads", "6", "--model.n_kv_heads", "4"],
        "model.n_heads (6) is not divisible by model.n_kv_heads (4): 6 / 4 = 1.5",
    ),
    "odd_head_dim": (
        None,
        ["--model.dim", "60", "--model.n_heads", "4", "--model.n_kv_heads", "2"],
        "head dim model.dim / model.n_heads = 60 / 4 = 15 is odd; RoPE rotates pairs",
    ),
    "seq_len_exceeds_max_seq_len": (
        None,
        ["--data.seq_len", "4096"],
        "data.seq_len (4096) exceeds model.max_seq_len (2048)",
    ),
    "zero_steps": (None, ["--train.steps", "0"], "train.steps must be positive, got 0"),
    "negative_lr": (None, ["--train.lr", "-1e-3"], "train.lr must be positive, got -0.001"),
    "negative_warmup": (
        None,
        ["--train.warmup_steps", "-1"],
        "train.warmup_steps must be >= 0, got -1",
    ),
    "zero_dim": (None, ["--model.dim", "0"], "model.dim must be positive, got 0"),
    "val_fraction_out_of_range": (
        None,
        ["--data.val_fraction", "1"],
        "data.val_fraction must lie strictly between 0 and 1, got 1.0",
    ),
    "beta_out_of_range": (None, ["--train.beta2", "1"], "train.beta2 must lie in [0, 1), got 1.0"),
    "dropout_out_of_range": (None, ["--model.dropout", "1"], "model.dropout must lie in [0, 1)"),
    "dropout_with_tensor_parallel": (
        None,
        ["--model.dropout", "0.1", "--parallel.tp", "2"],
        "model.dropout = 0.1 with parallel.tp = 2 is not supported",
    ),
    "unknown_checkpoint_format": (
        None,
        ["--checkpoint.format", "dcp"],
        "checkpoint.format = 'dcp' is not one of: 'whole', 'sharded'",
    ),
    "rope_scaling_below_one": (
        None,
        ["--model.rope_scaling", "0.5"],
        "model.rope_scaling must be >= 1 (1 = no scaling), got 0.5",
    ),
    "parallel_product_not_world": (
        None,
        ["--parallel.dp", "2"],
        "dp(2) * tp(1) * pp(1) * cp(1) = 2 != world size 1",
    ),
    "parallel_degree_zero": (None, ["--parallel.tp", "0"], "parallel.tp must be >= 1, got 0"),
    "unknown_preset": (
        None,
        ["--model.preset", "llama9"],
        "model.preset: unknown preset 'llama9'; known presets: tiny, deepseek-v3, "
        "deepseek-v2-lite, moe-tiny, quickstart, llama3-8b, llama3-70b, llama3-405b",
    ),
    "text_source_without_paths": (
        None,
        ["--data.source", "text"],
        "data.source = 'text' needs data.paths (files or directories)",
    ),
    "stdlib_source_with_paths": (
        None,
        ["--data.paths", "a.txt"],
        "data.paths is only used with data.source = 'text' or 'jsonl'",
    ),
    "invalid_toml": ("[train\nsteps = 10\n", [], "is not valid TOML"),
    "override_without_value": (None, ["--train.steps"], "override --train.steps has no value"),
    "override_followed_by_override": (
        None,
        ["--train.steps", "--train.lr", "1e-3"],
        "override --train.steps has no value",
    ),
    "override_without_section": (
        None,
        ["--steps", "10"],
        "override --steps: expected --section.key (e.g. --train.steps 200); sections are model,",
    ),
    "positional_argument": (
        None,
        ["steps=10"],
        "unexpected argument 'steps=10': overrides look like --section.key value",
    ),
    "bad_list_syntax": (
        None,
        ["--data.source", "text", "--data.paths", "[a"],
        "data.paths: cannot read '[a' as a list",
    ),
}


def _materialise(tmp_path: Path, toml_text: str | None) -> Path | None:
    if toml_text is None:
        return None
    path = tmp_path / "job.toml"
    path.write_text(toml_text)
    return path


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_config_raises_config_error(case, tmp_path):
    toml_text, overrides, message = BAD[case]
    path = _materialise(tmp_path, toml_text)
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_config(path, overrides)
    # One problem is one line; several are a readable list, each named once.
    expected = "invalid configuration:" + ("\n  - " if len(info.value.problems) > 1 else " ")
    assert str(info.value).startswith(expected)
    assert len(info.value.problems) >= 1


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=re.escape(f"config file '{missing}' does not exist")):
        load_config(missing, [])


def test_expert_parallel_validation():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"parallel": {"dp": 4, "ep": 3}}, world_size=4)
    assert (
        "parallel.ep (3) must divide dp x cp (4 x 1): experts fold over the data- and "
        "context-parallel ranks" in info.value.problems
    )
    # A dense model has no experts to split.
    assert any("needs a Mixture-of-Experts model" in p for p in info.value.problems)
    moe = {"model": {"preset": "moe-tiny"}}
    # ZeRO-1 and FSDP2 shard the experts over their replicas (and FSDP2 keeps the routing
    # biases whole), with and without ep; FSDP2 under pp stays refused for every family.
    for ep, zero in ((4, 1), (2, 3), (1, 3)):
        cfg = config_from_dict({**moe, "parallel": {"dp": 4, "ep": ep, "zero": zero}}, world_size=4)
        assert (cfg.parallel.ep, cfg.parallel.zero) == (ep, zero)
    cfg = config_from_dict(
        {**moe, "parallel": {"pp": 2, "dp": 2, "ep": 2, "zero": 1}}, world_size=4
    )
    assert cfg.parallel.pp == 2
    with pytest.raises(ConfigError) as info:
        config_from_dict({**moe, "parallel": {"pp": 2, "dp": 2, "ep": 2, "zero": 3}}, world_size=4)
    assert info.value.problems == [
        "parallel.zero = 3 with parallel.pp > 1: FSDP under pipeline parallelism is not "
        "built yet; use zero 0 or 1"
    ]
    with pytest.raises(ConfigError, match=r"n_routed_experts \(16\) must be divisible"):
        config_from_dict({**moe, "parallel": {"dp": 6, "ep": 6}}, world_size=6)
    cfg = config_from_dict({**moe, "parallel": {"dp": 4, "ep": 2}}, world_size=4)
    assert (cfg.parallel.ep, cfg.parallel.ep_dispatcher) == (2, "alltoall")
    # experts fold over dp x cp: ep 4 at dp 2 x cp 2
    cfg = config_from_dict({**moe, "parallel": {"dp": 2, "cp": 2, "ep": 4}}, world_size=4)
    assert cfg.parallel.ep == 4


def test_context_parallel_validation():
    """cp's arithmetic, each with its numbers: 2 x cp chunks (x tp under sp), heads per tp
    rank divisible by cp for all-to-all, no attention dropout in the ring."""
    cfg = config_from_dict({"parallel": {"dp": 2, "cp": 2}}, world_size=4)
    assert (cfg.parallel.cp, cfg.parallel.cp_comm) == (2, "ring")

    def problems(cfg: dict, world: int) -> list[str]:
        with pytest.raises(ConfigError) as info:
            config_from_dict(cfg, world_size=world)
        return info.value.problems

    assert problems({"parallel": {"cp": 4}, "data": {"seq_len": 100}}, 4) == [
        "data.seq_len (100) is not divisible by 2 x cp = 8: context parallelism splits each "
        "sequence into 2 x cp chunks (rank i holds chunks i and 2cp-1-i)"
    ]
    sp = {"parallel": {"cp": 2, "tp": 2, "sp": True}, "data": {"seq_len": 100}}
    assert "2 x cp x tp = 2 x 2 x 2 = 8" in problems(sp, 4)[0]
    a2a = {
        "parallel": {"cp": 4, "cp_comm": "alltoall", "tp": 4},
        "model": {"n_heads": 8, "n_kv_heads": 4},
    }
    assert problems(a2a, 16) == [
        "parallel.cp_comm = 'alltoall' needs the query heads per tp rank (model.n_heads / tp "
        "= 8 / 4 = 2) divisible by parallel.cp (4); use cp_comm = 'ring' or another cp"
    ]
    a2a["parallel"]["tp"] = 2  # 4 heads per tp rank: one per cp rank
    assert config_from_dict(a2a, world_size=8).parallel.cp_comm == "alltoall"
    dropout = {"parallel": {"cp": 2}, "model": {"dropout": 0.1}}
    assert "model.dropout = 0.1 with parallel.cp_comm = 'ring'" in problems(dropout, 2)[0]
    dropout["parallel"]["cp_comm"] = "alltoall"  # the whole-sequence core applies dropout
    assert config_from_dict(dropout, world_size=2).model.dropout == 0.1
    # MTP runs on whole sequences, gathered over cp (moe-tiny has an MTP module)
    mtp = config_from_dict({"model": {"preset": "moe-tiny"}, "parallel": {"cp": 2}}, world_size=2)
    assert mtp.model.mtp_depth > 0
    with pytest.raises(ConfigError, match="parallel.cp_comm"):
        config_from_dict({"parallel": {"cp": 2, "cp_comm": "p2p"}}, world_size=2)


def test_world_size_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=re.escape("dp(1) * tp(1) * pp(1) * cp(1) = 1 != world")):
        load_config(None, [])
    cfg = load_config(None, ["--parallel.dp", "2", "--parallel.tp", "2"])
    assert (cfg.parallel.dp, cfg.parallel.tp) == (2, 2)


def test_several_problems_reported_together(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[train]\nstpes = 10\n[model]\ndim = "wide"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, ["--precision.dtype", "fp7", "--logging.plot", "maybe"])
    problems = info.value.problems
    assert len(problems) == 4
    for expected in (
        "unknown key 'train.stpes'",
        "model.dim: expected an integer, got 'wide'",
        "precision.dtype = 'fp7' is not one of",
        "logging.plot: expected true or false, got 'maybe'",
    ):
        assert sum(expected in p for p in problems) == 1, (expected, problems)


def test_several_validation_problems_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config(
            None,
            [
                "--model.dim", "100", "--model.n_heads", "3", "--model.n_kv_heads", "2",
                "--train.steps", "0", "--data.val_fraction", "2", "--parallel.dp", "3",
            ],
        )  # fmt: skip
    problems = info.value.problems
    assert problems == [
        "model.dim (100) is not divisible by model.n_heads (3): 100 / 3 = 33.33",
        "model.n_heads (3) is not divisible by model.n_kv_heads (2): 3 / 2 = 1.5",
        "train.steps must be positive, got 0",
        "data.val_fraction must lie strictly between 0 and 1, got 2.0",
        "dp(3) * tp(1) * pp(1) * cp(1) = 3 != world size 1",
    ]


# --------------------------------------------------------------------------- through the CLI

CLI_CASES = [
    "unknown_key",
    "toml_string_for_int",
    "cli_not_a_number",
    "heads_do_not_divide_dim",
    "parallel_product_not_world",
    "invalid_toml",
    "override_without_value",
]


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Run the CLI cases two at a time (each pays ~1.5 s of interpreter + torch start-up)."""
    tmp = tmp_path_factory.mktemp("cli-config")
    commands = {}
    for case in [*CLI_CASES, "missing_file"]:
        if case == "missing_file":
            args = [str(tmp / "missing.toml")]
        else:
            toml_text, overrides, _ = BAD[case]
            args = []
            if toml_text is not None:
                path = tmp / f"{case}.toml"
                path.write_text(toml_text)
                args.append(str(path))
            args += overrides
        commands[case] = [sys.executable, "-m", "hyperloom", "config", "show", *args]

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(max_workers=2) as pool:  # the test machine has two cores
        results = pool.map(run, commands.values())
        return dict(zip(commands, results, strict=True))


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_reports_config_error_without_traceback(case, cli_results):
    result = cli_results[case]
    message = BAD[case][2]
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("hyperloom config: error: invalid configuration:")
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_cli_missing_config_file(cli_results, tmp_path_factory):
    result = cli_results["missing_file"]
    assert result.returncode == 2
    assert "missing.toml' does not exist" in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- well-formed jobs


def test_defaults_are_the_default_job():
    cfg = load_config(None, [])
    assert cfg == JobConfig()
    assert cfg.model.preset == "tiny" and cfg.model.dim == 384 and cfg.train.steps == 300
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 1  # type: ignore[misc]


def test_preset_fills_the_model_section():
    cfg = load_config(None, ["--model.preset", "llama3-8b"])
    m = cfg.model
    assert (m.preset, m.dim, m.n_layers, m.n_heads, m.n_kv_heads) == ("llama3-8b", 4096, 32, 32, 8)
    assert (m.ffn_dim, m.vocab_size, m.max_seq_len) == (14336, 128256, 131072)
    assert (m.rope_theta, m.rope_scaling, m.rope_original_max_seq) == (500000.0, 8.0, 8192)
    assert m.tie_embeddings is False


@pytest.mark.parametrize(
    "overrides",
    [
        ["--model.preset", "llama3-8b", "--model.n_layers", "2"],
        ["--model.n_layers", "2", "--model.preset", "llama3-8b"],  # order does not matter
        ["--model.preset=llama3-8b", "--model.n_layers=2"],
    ],
)
def test_key_set_alongside_preset_overrides_it(overrides):
    m = load_config(None, overrides).model
    assert (m.preset, m.n_layers, m.dim, m.n_heads) == ("llama3-8b", 2, 4096, 32)


def test_preset_in_toml_file_with_cli_override(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\npreset = "llama3-70b"\nn_layers = 4\n[train]\nsteps = 7\n')
    cfg = load_config(path, ["--model.n_layers", "3", "--train.lr", "1e-4"])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads) == (8192, 3, 64)
    assert (cfg.train.steps, cfg.train.lr) == (7, 1e-4)


def test_dumps_toml_round_trips(tmp_path):
    cfg = load_config(
        None,
        [
            "--model.preset", "llama3-8b", "--model.n_layers", "2", "--model.tie_embeddings", "yes",
            "--train.lr", "1.5e-4", "--train.schedule", "wsd", "--train.compile", "on",
            "--data.source", "text", "--data.paths", "a.txt,dir/b", "--data.val_fraction", "0.05",
            "--logging.plot", "off", "--logging.sample_prompt", 'say "hi"\n',
        ],
    )  # fmt: skip
    text = dumps_toml(cfg)
    assert tomllib.loads(text) == to_dict(cfg)
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    again = load_config(path, [])
    assert again == cfg
    assert again.data.paths == ["a.txt", "dir/b"]
    assert again.logging.sample_prompt == 'say "hi"\n'
    assert again.model.tie_embeddings is True and again.logging.plot is False
    # Every key is followed by its doc as a comment.
    assert re.search(r"^steps = 300\s+# optimizer steps to run$", dumps_toml(JobConfig()), re.M)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True), ("1", True), ("yes", True), ("ON", True),
        ("false", False), ("0", False), ("no", False), ("Off", False),
    ],
)  # fmt: skip
def test_cli_bool_parsing(text, expected):
    assert load_config(None, ["--logging.plot", text]).logging.plot is expected


def test_list_overrides_and_toml_arrays(tmp_path):
    base = ["--data.source", "text"]
    assert load_config(None, [*base, "--data.paths", "a,b"]).data.paths == ["a", "b"]
    assert load_config(None, [*base, "--data.paths=one"]).data.paths == ["one"]
    toml_array = ["--data.paths", '["x y", "z,w"]']
    assert load_config(None, [*base, *toml_array]).data.paths == ["x y", "z,w"]
    path = tmp_path / "job.toml"
    path.write_text('[data]\nsource = "jsonl"\npaths = ["p.jsonl", "q"]\n')
    assert load_config(path, []).data.paths == ["p.jsonl", "q"]
    # A later override replaces the file's list (it does not append).
    assert load_config(path, ["--data.paths", "r"]).data.paths == ["r"]


def test_value_conversions():
    cfg = load_config(None, ["--train.steps", "1_000", "--train.lr", "2e-4", "--model.dim=192"])
    assert cfg.train.steps == 1000 and type(cfg.train.steps) is int
    assert cfg.train.lr == 2e-4 and cfg.model.dim == 192
    # A TOML integer is accepted where a float is expected and becomes a float.
    cfg = config_from_dict({"train": {"lr": 1}})
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float


def test_parse_overrides_keeps_strings_and_dashes():
    raw = parse_overrides(["--train.grad-clip", "0.5", "--model.dim=128"])
    assert raw == {"train": {"grad_clip": "0.5"}, "model": {"dim": "128"}}
    assert load_config(None, ["--train.grad-clip", "0.5"]).train.grad_clip == 0.5


# --------------------------------------------------------------------------- a leaf package


def test_config_is_a_leaf_that_loads_presets_alone():
    """Importing hyperloom.config and loading a preset job loads no other hyperloom module
    (nor torch): every layer can read a job, and a config error costs no model import."""
    code = (
        "import sys\n"
        "from hyperloom.config import load_config\n"
        "m = load_config(None, ['--model.preset', 'moe-tiny', '--model.n_layers', '3']).model\n"
        "assert (m.family, m.n_routed_experts, m.n_layers) == ('deepseek', 16, 3), m\n"
        "print(sorted(n for n in sys.modules if n.startswith('hyperloom') or n == 'torch'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    loaded = ast.literal_eval(result.stdout)
    assert [n for n in loaded if n != "hyperloom" and not n.startswith("hyperloom.config")] == []


def test_config_sources_import_only_the_config_package():
    """No import of another hyperloom package anywhere in hyperloom/config/, lazy or not."""
    import hyperloom.config

    root = Path(hyperloom.config.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                names = [node.module or ""]
            for name in names:
                assert name != "importlib" and not name.startswith("importlib."), path
                if name.split(".")[0] == "hyperloom":
                    assert name.startswith("hyperloom.config"), f"{path} imports {name}"


def test_model_fields_keep_the_section_order():
    """The family groups compose one flat [model] table in its documented order."""
    from hyperloom.config import ModelConfig

    names = [f.name for f in dataclasses.fields(ModelConfig)]
    assert names[:3] == ["preset", "family", "vocab_size"]
    assert names.index("dropout") + 1 == names.index("n_routed_experts")
    assert names.index("mtp_loss_weight") + 1 == names.index("vlm_decoder")
    assert names[-2:] == ["pixel_shuffle", "image_token_id"]
    assert len(names) == 65  # 2 choice + 21 decoder + 24 deepseek + 18 vision keys


def test_schedule_shapes_have_one_rule():
    """The job's validation and the schedule generators state a broken shape alike."""
    from hyperloom.config import PIPELINE_SCHEDULES, schedule_shape_problems
    from hyperloom.pipeline import SCHEDULES, ScheduleError, build_schedule, dualpipe

    assert tuple(SCHEDULES) == PIPELINE_SCHEDULES
    (problem,) = schedule_shape_problems("dualpipe", 3, 6)
    for build in (lambda: build_schedule("dualpipe", 3, 6), lambda: dualpipe(3, 6)):
        with pytest.raises(ScheduleError) as info:
            build()
        assert str(info.value) == problem
    with pytest.raises(ConfigError) as info:
        config_from_dict({"parallel": {"pp": 3, "pp_schedule": "dualpipe"}}, world_size=3)
    assert info.value.problems == [f"parallel.pp_schedule = 'dualpipe': {problem}"]
    assert schedule_shape_problems("dualpipe", 4, 8) == []


def test_inject_specs_parse_in_the_config():
    """The fault-drill grammar is the config's; the drills' runtime uses the same one."""
    from hyperloom.config import Fault, parse_inject
    from hyperloom.resilience import inject

    assert inject.parse_inject is parse_inject
    assert parse_inject("crash@4:r1, nan_grad@2") == [
        Fault("crash", 4, 1),
        Fault("nan_grad", 2, None),
    ]
    with pytest.raises(ConfigError, match=re.escape("resilience.inject: cannot read 'hang@0'")):
        load_config(None, ["--resilience.inject", "hang@0"])


def test_ep_overlap_validation():
    """parallel.ep_overlap needs all-to-alls to hide and a schedule that pairs a forward with
    another micro-batch's backward; each gap is named with what to change."""
    moe = {"preset": "moe-tiny"}
    ok = {"pp": 2, "dp": 2, "ep": 2, "pp_schedule": "dualpipe", "ep_overlap": True}
    cfg = config_from_dict({"model": moe, "parallel": ok}, world_size=4)
    assert cfg.parallel.ep_overlap
    cases = [
        ({**ok, "ep": 1}, "it needs parallel.ep > 1 and parallel.ep_dispatcher = 'alltoall'"),
        ({**ok, "ep_dispatcher": "allgather"}, "ep_dispatcher = 'allgather')"),
        ({**ok, "pp_schedule": "1f1b"}, "pp_schedule = '1f1b' cannot form"),
        # pp = 1: gradient accumulation's pairs, which need two micro-batches and no FSDP2
        ({**ok, "pp": 1, "dp": 4, "pp_schedule": "1f1b"}, "train.grad_accum >= 2, got 1"),
        ({**ok, "pp": 1, "dp": 4, "zero": 3}, "parallel.zero = 3 is not supported: FSDP2"),
    ]
    acc = {"parallel": {**ok, "pp": 1, "dp": 4}, "train": {"grad_accum": 2}}
    assert config_from_dict({"model": moe, **acc}, world_size=4).parallel.ep_overlap
    for par, words in cases:
        with pytest.raises(ConfigError) as info:
            config_from_dict({"model": moe, "parallel": par}, world_size=4)
        assert any(words in p for p in info.value.problems), (par, info.value.problems)
    # Dropout under recompute: the recomputing lane would move the other lane's RNG.
    model = {**moe, "dropout": 0.1}
    config_from_dict({"model": model, "parallel": ok}, world_size=4)  # no recompute: fine
    with pytest.raises(ConfigError, match="a recomputing lane sets the shared RNG"):
        config_from_dict(
            {"model": model, "parallel": ok, "train": {"recompute": "full"}}, world_size=4
        )


def test_expert_tensor_parallel_validation():
    """parallel.etp: a divisor of tp, an MoE model whose expert width splits into etp parts,
    FP8 block recipes whose blocks fit each rank's slice."""
    moe = {"model": {"preset": "moe-tiny"}}  # moe_ffn_dim 192
    cfg = config_from_dict({**moe, "parallel": {"tp": 2, "etp": 2}}, world_size=2)
    assert (cfg.parallel.tp, cfg.parallel.etp) == (2, 2)
    assert config_from_dict({}, world_size=1).parallel.etp == 1
    # composes with ep (experts over ep, hidden width over etp) and ZeRO-1
    par = {"tp": 2, "etp": 2, "dp": 2, "ep": 2, "zero": 1}
    assert config_from_dict({**moe, "parallel": par}, world_size=4).parallel.etp == 2

    def problems(cfg: dict, world: int) -> list[str]:
        with pytest.raises(ConfigError) as info:
            config_from_dict(cfg, world_size=world)
        return info.value.problems

    assert problems({**moe, "parallel": {"tp": 2, "etp": 4}}, 2) == [
        "parallel.etp (4) must divide parallel.tp (2): the expert tensor-parallel groups are "
        "consecutive runs of etp ranks inside each tp group"
    ]
    assert problems({**moe, "parallel": {"etp": 0}}, 1) == ["parallel.etp must be >= 1, got 0"]
    odd = {"model": {"preset": "moe-tiny", "moe_ffn_dim": 190}, "parallel": {"tp": 4, "etp": 4}}
    assert (
        "model.moe_ffn_dim (190) is not divisible by parallel.etp (4): each expert tensor-"
        "parallel rank holds a whole share of every expert's hidden width, 190 / 4 = 47.5"
    ) in problems(odd, 4)
    assert problems({"parallel": {"tp": 2, "etp": 2}}, 2) == [
        "parallel.etp = 2 splits routed experts: it needs a Mixture-of-Experts model "
        "(model.n_routed_experts > 0)"
    ]
    # sequence parallelism with etp = tp: the rows gathered over the etp group
    sp = {"tp": 2, "etp": 2, "sp": True}
    assert config_from_dict({**moe, "parallel": sp}, world_size=2).parallel.sp
    # ... and with etp < tp (the slices' gradients summed over the ranks holding them), under
    # FSDP2 and in sharded checkpoints
    sp_part = {**moe, "parallel": {"tp": 4, "etp": 2, "sp": True}}
    assert config_from_dict(sp_part, world_size=4).parallel.etp == 2
    fsdp = {**moe, "parallel": {"tp": 2, "etp": 2, "dp": 2, "zero": 3}}
    assert config_from_dict(fsdp, world_size=4).parallel.zero == 3
    sharded = {**moe, "parallel": {"tp": 2, "etp": 2}, "checkpoint": {"format": "sharded"}}
    assert config_from_dict(sharded, world_size=2).checkpoint.format == "sharded"
    # FP8 experts on the slices (amaxes reduced over etp); block recipes need whole blocks
    fp8 = {**moe, "parallel": {"tp": 2, "etp": 2}, "precision": {"fp8": "current"}}
    assert config_from_dict(fp8, world_size=2).precision.fp8 == "current"
    mx = {"model": {"preset": "moe-tiny", "moe_ffn_dim": 80}, "precision": {"fp8": "mxfp8"}}
    assert (
        "precision.fp8 = 'mxfp8' with parallel.etp = 2: each rank's slice of "
        "model.moe_ffn_dim, 80 / 2 = 40, is not a multiple of the 32-element scale block, so "
        "blocks would straddle ranks; make model.moe_ffn_dim a multiple of 64"
    ) in problems({**mx, "parallel": {"tp": 2, "etp": 2}}, 2)
    mx["model"]["moe_ffn_dim"] = 128  # 64 per rank: whole 32-wide blocks
    assert config_from_dict({**mx, "parallel": {"tp": 2, "etp": 2}}, world_size=2).parallel.etp
    # the overlapped ep lanes (the etp collectives run inside a lane)
    overlap = {"pp": 2, "dp": 2, "ep": 2, "tp": 2, "etp": 2, "pp_schedule": "dualpipe"}
    on = config_from_dict({**moe, "parallel": {**overlap, "ep_overlap": True}}, world_size=8)
    assert on.parallel.ep_overlap


def test_a_saved_config_loads_without_its_hf_directory(tmp_path):
    """A run's config.toml sets every model field, so `preset = "hf:DIR"` needs no DIR to
    load again (generate / export after DIR is gone); a partial table still reads DIR."""
    import dataclasses

    from hyperloom.config import ConfigError, ModelConfig, config_from_dict

    gone = str(tmp_path / "gone")
    full = dataclasses.asdict(ModelConfig()) | {"preset": f"hf:{gone}", "dim": 192}
    assert config_from_dict({"model": full}, world_size=1).model.dim == 192
    partial = {k: v for k, v in full.items() if k != "dim"}
    with pytest.raises(ConfigError, match="model.preset"):
        config_from_dict({"model": partial}, world_size=1)


@pytest.mark.parametrize("name", ["quickstart", "tiny", "vlm-tiny"])
def test_one_process_configs_load(name):
    """The configs a user runs first load and validate as written (quickstart.sh's job)."""
    from hyperloom.config import load_config

    cfg = load_config(Path(__file__).parents[2] / "configs" / f"{name}.toml", world_size=1)
    assert cfg.data.seq_len <= cfg.model.max_seq_len
    if name == "quickstart":
        assert cfg.model.preset == "quickstart" and cfg.model.vocab_size == 8192
