"""benchmarks/fp8_layer_stack.py, the FP8 engine's end-to-end GPU check, run small on CPU: it
trains the stack in every contender, compares each first output with BF16's, and refuses bad
arguments with a message."""

from __future__ import annotations

import json

import pytest

BENCHMARK = "fp8_layer_stack"  # the conftest `bench` fixture imports it


def test_small_stack_runs_every_recipe(bench, tmp_path):
    out = tmp_path / "stack.json"
    argv = ["--preset", "tiny", "--layers", "2", "--tokens", "64", "--seq-len", "32"]
    argv += ["--warmup", "1", "--steps", "1", "--threads", "1", "--json", str(out)]
    payload = bench.main(argv)
    rows = {r["recipe"]: r for r in payload["rows"]}
    assert list(rows) == ["bf16", *bench.RECIPES]
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0
    assert rows["bf16"]["update_rel_error_vs_bf16"] == 0.0
    for name in bench.RECIPES:
        r = rows[name]
        assert r["step_ms_median"] > 0 and r["tokens_per_s"] > 0
        # The same weights and input through FP8 linears: what the blocks add is a few percent
        # from BF16 (3 mantissa bits), not equal to it, and never NaN (delayed scaling's
        # buffers start from reset state, not from what to_empty left; its first step casts
        # with scale 1, hence its looser bound).
        err = r["update_rel_error_vs_bf16"]
        assert 0.01 < err < (0.2 if name == "delayed" else 0.12), (name, err)
    saved = json.loads(out.read_text())
    assert saved["layers"] == 2 and len(saved["rows"]) == len(rows)
    assert "CPU emulation" in saved["verdict"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recipes", "current,fp4"], "unknown ['fp4']"),
        (["--tokens", "100", "--seq-len", "64"], "multiple of --seq-len"),
        (["--layers", "0"], "at least 1"),
    ],
)
def test_bad_arguments_say_what_is_wrong(bench, argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
