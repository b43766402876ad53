"""End-to-end tests of the `hyperloom` command line, each in a subprocess (`python -m hyperloom`)."""

from __future__ import annotations

import json
import sys

import pytest

from hyperloom.config import JobConfig, to_dict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def test_model_info_json(cli):
    result = cli("model", "info", "llama3-8b", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["parameters"] == 8_030_261_248
    assert info["flops_per_token"] == 57_912_852_480 and info["seq_len"] == 8192
    assert (info["dim"], info["n_layers"], info["vocab_size"]) == (4096, 32, 128256)


def test_model_info_table_lists_every_preset(cli):
    result = cli("model", "info")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│")}
    assert set(rows) == {
        "tiny",
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "deepseek-v3",
        "deepseek-v2-lite",
        "moe-tiny",
        "quickstart",
        "llava-1.5-7b",
        "vlm-tiny",
    }
    assert "8,030,261,248" in rows["llama3-8b"]
    assert "7,063,427,072" in rows["llava-1.5-7b"]
    assert "70,553,706,496" in rows["llama3-70b"]
    assert "405,853,388,800" in rows["llama3-405b"]
    # DeepSeek-V3 as published: 671B total, 37B activated per token (MTP counted apart)
    assert "(671B)" in rows["deepseek-v3"] and "(37B)" in rows["deepseek-v3"]


def test_model_info_unknown_preset_and_stray_override(cli):
    result = cli("model", "info", "gpt5")
    assert result.returncode == 2
    assert "hyperloom model: error: invalid configuration" in result.stderr
    assert "unknown preset 'gpt5'; known presets: tiny, deepseek-v3" in result.stderr
    assert "Traceback" not in result.stderr
    stray = cli("model", "info", "--train.steps", "3")  # overrides belong to train/config
    assert stray.returncode == 2
    assert "unrecognized arguments: --train.steps 3" in stray.stderr


def test_config_show_prints_the_defaults_as_toml(cli):
    result = cli("config", "show")
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout) == to_dict(JobConfig())
    assert "# optimizer steps to run" in result.stdout


def test_commands_without_a_model_do_not_import_torch():
    """Commands that build no model answer without importing torch (1.5-1.7 s of a 2-3 s
    command before), and so do their user errors: `config show` and a config error (the
    registry, the checkpoint converter and the error handling import torch only where they
    need it), `model info` (the families export their model classes lazily) and a plan or
    schedule error (caught before the handler that imports torch-heavy modules)."""
    import subprocess

    probe = (
        "import runpy, sys; sys.argv = ['hyperloom', *sys.argv[1:]]\n"
        "try: runpy.run_module('hyperloom', run_name='__main__')\n"
        "except SystemExit as e: code = e.code\n"
        "print('torch' in sys.modules, code, file=sys.stderr)"
    )
    cases = [
        (["config", "show"], 0),
        (["config", "show", "--model.dimm", "8"], 2),
        (["model", "info", "all"], 0),
        (["model", "info", "nope"], 2),
        (["plan", "--model", "llama3-8b", "--gpus", "8"], 2),
        (["schedule", "1f1b", "--pp", "2", "--microbatches", "0"], 2),
    ]
    for argv, code in cases:
        cmd = [sys.executable, "-c", probe, *argv]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert result.stderr.splitlines()[-1] == f"False {code}", (argv, result.stderr)
        if code:
            assert "error:" in result.stderr and "Traceback" not in result.stderr, argv


def test_device_errors_are_user_errors(cli, tmp_path):
    """An accelerator problem ends with the one-line message and status 2, no traceback."""
    import torch

    cases = [("bogus", "unknown device 'bogus'")]
    if not torch.cuda.is_available():
        cases.append(("cuda", "is not available"))
    for device, message in cases:
        result = cli("train", "--run-dir", str(tmp_path), "--train.device", device)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_job_args, cli):
    from hyperloom.planner.hardware import get_profile, save_profile

    run_dir = tmp_path_factory.mktemp("cli") / "run"
    # a saved profile: the self-check predicts without calibrating this machine
    profile = save_profile(get_profile("h100"), run_dir.parent / "h100.json")
    args = tiny_job_args(
        run_dir, train__steps=12, logging__sample_tokens=8, logging__self_check=str(profile)
    )
    args = args[: args.index("--logging.run_dir")] + args[args.index("--logging.run_dir") + 2 :]
    result = cli("train", "--run-dir", str(run_dir), *args)
    return run_dir, result


def test_train_prints_summary_and_sample(trained_run):
    run_dir, result = trained_run
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "hyperloom run summary" in out
    for row in ("final val loss", "tokens per s", "parameters", "139,584"):
        assert row in out, row
    assert "sample" in out
    sample = json.loads((run_dir / "summary.json").read_text())["sample"]
    assert sample.startswith("def ") and len(sample) > len("def ")
    assert sample.splitlines()[0] in out
    assert f"run directory: {run_dir}" in out
    assert (run_dir / "checkpoints" / "step_00000012" / "model.safetensors").is_file()


def test_summary_names_one_peak_memory_and_follows_the_sample(trained_run):
    """The table shows one measured peak-memory figure, named for what it measures, the
    losses in bits per byte, and the planner's predictions as predicted / measured pairs,
    computed after the sample is shown (a first calibration must not delay it)."""
    run_dir, result = trained_run
    out = result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    peak_rows = [line for line in out.splitlines() if "peak memory" in line]
    assert len(peak_rows) == 1, peak_rows
    assert summary["peak_memory_measures"] in peak_rows[0]  # e.g. "process resident set (RSS)"
    assert f"{summary['peak_memory_gb']:,.4g}" in peak_rows[0]
    assert "final val bits per byte" in out and f"{summary['final_val_bpb']:,.4g}" in out
    step_row = next(line for line in out.splitlines() if "planner step time" in line)
    p, m = summary["predicted_step_s"], summary["measured_step_s"]
    assert f"{p:.3g} / {m:.3g} s" in step_row
    assert out.index(summary["sample"].splitlines()[0]) < out.index("planner step time")


def test_generate_from_run_dir(trained_run, cli):
    run_dir, _ = trained_run
    common = ["--checkpoint", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8"]
    result = cli("generate", *common, "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ")
    assert len(result.stdout.rstrip("\n")) > len("def ")
    assert "prompt tokens" in result.stderr and "KV cache" in result.stderr
    # Greedy decoding does not depend on the KV cache.
    uncached = cli("generate", *common, "--temperature", "0", "--no-cache")
    assert uncached.returncode == 0, uncached.stderr
    assert uncached.stdout == result.stdout


def test_generate_without_checkpoint_is_a_clear_error(tmp_path, cli):
    result = cli("generate", "--checkpoint", str(tmp_path), "--prompt", "def ")
    assert result.returncode == 2
    assert result.stderr.startswith("hyperloom generate: error: ")
    assert f"'{tmp_path}' is neither a checkpoint directory" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_a_rank_whose_peer_died_reports_one_line(monkeypatch):
    """A collective failing because another rank died is one line on the surviving rank,
    not gloo's traceback; outside torchrun, and for other errors, nothing is hidden."""
    from hyperloom.cli import lost_peer, lost_peer_line

    gone = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242\nmore"
    )
    monkeypatch.delenv("RANK", raising=False)
    assert not lost_peer(gone)
    monkeypatch.setenv("RANK", "1")
    assert lost_peer(gone) and not lost_peer(RuntimeError("shape mismatch"))
    line = lost_peer_line("train", gone)
    assert "\n" not in line and "(rank 1)" in line and "Connection closed by peer" in line


@pytest.mark.parametrize(
    "argv",
    [
        "plan --model llama3-8b --gpus 8 --top -1",
        "plan --model llama3-8b --gpus 8 --intra-gbs inf",
        "plan --model llama3-8b --gpus 8 --margin-gib -5",
        "schedule 1f1b --pp 2 -m 4 --f nan",
        "schedule 1f1b --pp 2 -m 4 --comm inf",
        "drill crash --nproc 0",
    ],
)
def test_numeric_flags_out_of_range_are_one_line_errors(argv, capsys):
    from hyperloom.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv.split())
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert argv.split()[-2] in err and "must be a finite" in err, err  # names the flag
