"""The strategy search, the `hyperloom plan` command and calibration."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from hyperloom.config import preset_config
from hyperloom.planner import Cluster, ModelSpec, PlanError, SearchSpace, search
from hyperloom.planner.cli import add_plan_parser, parse_fix
from hyperloom.planner.strategy import check

LLAMA8B = ModelSpec.from_model_config(preset_config("llama3-8b"))
LLAMA70B = ModelSpec.from_model_config(preset_config("llama3-70b"))


def test_search_prunes_over_memory_and_returns_valid_fitting_plans():
    space = SearchSpace(fp8=(False,), zero=(0, 1))
    result = search(LLAMA70B, Cluster.of("h100", 64), 128, 8192, space=space, top_k=5)
    assert result.rejected["over memory"] > 0
    assert result.rejected["bounded out (time)"] > 0
    assert len(result.top) == 5
    times = [p.step_time for p in result.top]
    assert all(a <= b * 1.001 for a, b in zip(times, times[1:], strict=False))  # ties
    for plan in result.top:
        s = plan.strategy
        assert check(s, LLAMA70B, 8192, 64) is None
        assert LLAMA70B.n_heads % s.tp == 0 and LLAMA70B.n_kv_heads % s.tp == 0
        assert s.world == 64 and s.global_batch == 128
        assert plan.fits and plan.reserved_memory <= plan.capacity
    # the search's answer is at least as good as a hand-picked sensible layout
    from hyperloom.planner import Strategy, predict

    hand = predict(
        LLAMA70B,
        Cluster.of("h100", 64),
        Strategy(tp=8, pp=4, dp=2, zero=1, mbs=1, microbatches=64, recompute="selective"),
        8192,
    )
    assert result.top[0].step_time <= hand.step_time


def test_nothing_fits_is_a_user_error():
    with pytest.raises(PlanError, match="fits"):
        search(LLAMA70B, Cluster.of("h100", 8), 8, 8192, space=SearchSpace(tp=(1,), pp=(1,)))


def test_fixed_dimensions_are_respected():
    space = SearchSpace().fixed(**parse_fix("tp=4,pp=2/4,schedule=1f1b,fp8=false"))
    result = search(LLAMA8B, Cluster.of("h100", 32), 64, 4096, space=space, top_k=3)
    assert {p.strategy.tp for p in result.top} == {4}
    assert {p.strategy.pp for p in result.top} <= {2, 4}
    with pytest.raises(PlanError, match="NAME=VALUE"):
        parse_fix("tp")
    with pytest.raises(PlanError, match="not a int"):
        parse_fix("tp=x")


@pytest.mark.slow
def test_70b_on_1024_h100_answers_fast():
    start = time.perf_counter()
    result = search(LLAMA70B, Cluster.of("h100", 1024), 1024, 8192)
    took = time.perf_counter() - start
    assert took < 60, f"search took {took:.1f} s"
    assert result.enumerated > 10_000 and result.configs_per_s > 300
    assert result.top[0].mfu > 0.3 and result.top[0].fits


def _run(argv: list[str], overrides: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    args.overrides = overrides or []
    return args.func(args)


def test_cli_search_writes_json_and_pictures(tmp_path, capsys):
    prefix = tmp_path / "p"
    rc = _run(
        [
            "plan",
            "--model",
            "llama3-8b",
            "--gpus",
            "16",
            "--global-batch",
            "32",
            "--seq",
            "4096",
            "--top",
            "3",
            "--fix",
            "fp8=false,zero=1",
            "--json",
            str(tmp_path / "p.json"),
            "--png-prefix",
            str(prefix),
        ]
    )
    assert rc == 0
    body = json.loads((tmp_path / "p.json").read_text())
    assert len(body["plans"]) == 3 and body["search"]["enumerated"] > 0
    assert body["query"]["model"] == "llama3-8b"
    for name in ("memory", "timeline", "top"):
        assert (tmp_path / f"p_{name}.png").stat().st_size > 1000
    assert "searched" in capsys.readouterr().out


def test_cli_predicts_a_job_config_with_pipeline(tmp_path, capsys):
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        '[model]\npreset = "llama3-8b"\n[parallel]\ntp = 2\npp = 2\ndp = 2\nzero = 1\n'
        "sp = true\n[train]\nmicro_batch_size = 1\ngrad_accum = 8\n[data]\nseq_len = 4096\n"
    )
    rc = _run(
        [
            "plan",
            str(cfg),
            "--schedule",
            "interleaved",
            "--vpp",
            "2",
            "--recompute",
            "selective",
            "--json",
            str(tmp_path / "one.json"),
        ],
        ["--train.grad_accum", "4"],
    )
    assert rc == 0
    (plan,) = json.loads((tmp_path / "one.json").read_text())["plans"]
    # parallel.microbatches defaults to 2 x pp = 4 per flush, times grad_accum 4
    assert plan["strategy"]["pp"] == 2 and plan["strategy"]["microbatches"] == 16
    assert plan["gpus"] == 8 and plan["seq"] == 4096
    assert "memory per pipeline rank" in capsys.readouterr().out
    with pytest.raises(PlanError, match="--model"):
        _run(["plan"])


def test_calibrate_writes_a_profile_the_planner_uses(tmp_path):
    from hyperloom.planner import predict
    from hyperloom.planner.calibrate import calibrate
    from hyperloom.planner.hardware import get_profile, save_profile
    from hyperloom.planner.strategy import Strategy

    heard: list[str] = []
    profile, raw = calibrate(
        device="cpu", dtype="fp32", quick=True, collectives=False, progress=heard.append
    )
    assert heard[0].startswith("GEMMs") and any("attention" in h for h in heard)
    assert profile.bf16_tflops > 0 and profile.hbm_gbs > 0 and profile.gemm_table
    assert 0 < profile.elementwise_eff <= 1 and len(profile.attn_table) == 2  # quick: 2 lengths
    assert all(0 < f <= 1 and 0 < b <= 1 for _, f, b in profile.attn_table)
    assert 0 < profile.layer_overhead_s < 0.1  # host seconds per layer, forward + backward
    assert max(e for _, e in profile.gemm_table) == pytest.approx(1.0)
    path = save_profile(profile, tmp_path / "cpu.json", raw)
    loaded = get_profile(str(path))
    assert loaded == profile
    tiny = ModelSpec.from_model_config(preset_config("tiny"))
    plan = predict(tiny, Cluster(loaded, 1, 1), Strategy(mbs=8), 256)
    assert plan.step_time > 0


def _plans(path) -> list[dict]:
    return json.loads(path.read_text())["plans"]


def test_plan_subcommands_answer_as_the_plain_command(tmp_path, capsys):
    """`plan predict CONFIG` is `plan CONFIG`, `plan search --model` is `plan --model`; an
    option before the CONFIG still counts, and `plan search CONFIG` searches the job's model,
    GPUs and batch."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        '[model]\npreset = "llama3-8b"\n[parallel]\ntp = 2\ndp = 4\n[train]\nmicro_batch_size = 1\n'
        "[data]\nseq_len = 4096\n"
    )
    one = ["--json", str(tmp_path / "a.json")]
    assert _run(["plan", str(cfg), "--recompute", "full", *one]) == 0
    two = ["--json", str(tmp_path / "b.json")]
    assert _run(["plan", "predict", str(cfg), "--recompute", "full", *two]) == 0
    assert _plans(tmp_path / "a.json") == _plans(tmp_path / "b.json")
    assert _run(["plan", "--accelerator", "a100", str(cfg), *one]) == 0
    assert _plans(tmp_path / "a.json")[0]["accelerator"] == "a100"
    query = ["--model", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--top", "2"]
    query += ["--fix", "tp=2,pp=1,cp=1,zero=1,fp8=false,recompute=none"]
    assert _run(["plan", *query, *one]) == 0
    assert _run(["plan", "search", *query, *two]) == 0
    assert _plans(tmp_path / "a.json") == _plans(tmp_path / "b.json")
    assert _run(["plan", "search", str(cfg), "--top", "2", "--fix", "tp=2,pp=1", *one]) == 0
    body = json.loads((tmp_path / "a.json").read_text())
    assert body["query"]["gpus"] == 8 and body["query"]["global_batch"] == 4
    assert "searched" in capsys.readouterr().out


def test_plan_help_lists_the_subcommands_and_calibrate_gets_the_trainers_probe(monkeypatch):
    import hyperloom.cli as top
    from hyperloom.planner import calibrate as cal

    text = add_plan_parser(argparse.ArgumentParser().add_subparsers()).format_help()
    assert all(f"\n    {mode} " in text for mode in ("predict", "search", "calibrate"))
    parser = top.build_parser()
    seen = {}
    monkeypatch.setattr(cal, "cmd_calibrate", lambda args, probe: seen.update(probe=probe) or 0)
    args = parser.parse_args(["plan", "calibrate", "--quick", "--out", "x.json"])
    assert args.func(args) == 0 and args.quick and args.out == "x.json"
    assert seen["probe"] is top._runtime_memory  # the CLI hands the planner the trainer's probe
    args = parser.parse_args(["plan", "predict"])  # predict needs a CONFIG or model flags
    args.overrides = []
    with pytest.raises(PlanError, match="needs a job CONFIG or the model as flags"):
        args.func(args)
