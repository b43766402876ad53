"""The planner's boundary: it reads the job config (one description of the model and the
layout) and never imports the trainer, which hands it measurements instead."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from hyperloom.config import load_config, preset_config
from hyperloom.planner import ModelSpec, Runtime, Strategy

PLANNER = Path(__file__).resolve().parents[2] / "hyperloom" / "planner"


def _mentions_train(node: ast.AST) -> str | None:
    """How `node` reaches hyperloom.train, if it does: an import anywhere (module level or in
    a function), or a string naming the package (importlib, `python -c` code, dotted calls)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""]
        if node.module == "hyperloom":
            names = [f"hyperloom.{a.name}" for a in node.names]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        names = [node.value] if "hyperloom.train" in node.value else []
        return f"string {node.value[:60]!r}" if names else None
    else:
        return None
    hits = [n for n in names if n == "hyperloom.train" or n.startswith("hyperloom.train.")]
    return f"import {hits[0]}" if hits else None


def test_no_planner_module_imports_the_trainer():
    found = []
    for path in sorted(PLANNER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if how := _mentions_train(node):
                found.append(f"{path.name}:{node.lineno}: {how}")
    assert not found, "the planner must not reach hyperloom.train:\n" + "\n".join(found)


def test_the_boundary_check_sees_imports_in_functions_and_strings():
    code = (
        "def f():\n    from hyperloom.train.trainer import Trainer\n"
        "def g():\n    import importlib\n    importlib.import_module('hyperloom.train.probe')\n"
        "CMD = 'from hyperloom.train import probe'\n"
        "from hyperloom import train\n"
    )
    hows = sorted(h for n in ast.walk(ast.parse(code)) if (h := _mentions_train(n)))
    assert hows == [
        "import hyperloom.train",
        "import hyperloom.train.trainer",
        "string 'from hyperloom.train import probe'",
        "string 'hyperloom.train.probe'",
    ]


def test_model_spec_reads_its_shapes_from_the_model_config():
    cfg = preset_config("llama3-8b")
    spec = ModelSpec.from_model_config(cfg)
    assert spec.config is cfg and spec.name == "llama3-8b"
    assert (spec.n_layers, spec.dim, spec.ffn_dim) == (cfg.n_layers, cfg.dim, cfg.ffn_dim)
    assert spec.n_routed_experts == 0 and spec.moe_n_groups == 1  # dense: no DeepSeek shapes
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dim = 1  # type: ignore[misc]
    with pytest.raises(TypeError):  # no second copy of a shape to set out of sync
        dataclasses.replace(spec, dim=1)
    wider = spec.with_config(dim=8192, n_heads=64)
    assert wider.dim == 8192 and wider.params() > spec.params()
    moe = ModelSpec.from_model_config(preset_config("deepseek-v3"))
    assert moe.mla and moe.n_routed_experts == 256 and moe.n_dense_layers == 3


def test_strategy_and_runtime_come_from_the_job_keys_train_reads():
    overrides = ["--parallel.pp", "2", "--parallel.dp", "2", "--parallel.tp", "2"]
    overrides += ["--parallel.sp", "true", "--parallel.pp_schedule", "interleaved"]
    overrides += ["--parallel.vpp", "2", "--parallel.zero", "1", "--train.grad_accum", "3"]
    overrides += ["--train.micro_batch_size", "4", "--precision.fp8", "current"]
    job = load_config(None, overrides, world_size=8)
    s = Strategy.from_job(job)
    assert (s.tp, s.pp, s.dp, s.zero, s.sp, s.vpp) == (2, 2, 2, 1, True, 2)
    assert s.schedule == "interleaved" and s.fp8 and s.mbs == 4
    assert s.microbatches == 2 * 2 * 3  # parallel.microbatches (0 = 2 x pp) x grad_accum
    assert s.world == 8 and s.global_batch == 2 * 4 * 12
    flags = Strategy.from_job(job, schedule="1f1b", recompute="full", fp8=False)
    assert (flags.schedule, flags.vpp, flags.recompute, flags.fp8) == ("1f1b", 1, "full", False)
    rt = Runtime.from_job(job)
    assert rt.autocast_per_op and rt.fused_cross_entropy  # tp > 1: the chunked operator


def test_the_plan_runs_the_jobs_recompute_policy():
    """`hyperloom plan CONFIG` costs the recompute the job will run (train.recompute), a flag
    overrides it, and a partial policy it cannot cost is refused rather than mis-planned."""
    from hyperloom.planner import PlanError

    job = load_config(None, ["--train.recompute", "selective"])
    assert Strategy.from_job(job).recompute == "selective"
    assert Strategy.from_job(job, recompute="full").recompute == "full"
    partial = load_config(None, ["--train.recompute", "full", "--train.recompute_layers", "2"])
    with pytest.raises(PlanError, match="recompute_layers"):
        Strategy.from_job(partial)


def test_moe_imbalance_is_set_from_the_command_line(cli, tmp_path):
    """`--moe-imbalance`: the busiest expert-parallel rank's share of the routed tokens
    (issue 34, finding 5). More imbalance, a slower step; it is recorded in the JSON; below 1
    is refused in one line."""
    job = tmp_path / "ds.toml"
    job.write_text(
        '[model]\npreset = "deepseek-v3"\n[data]\nseq_len = 4096\n'
        "[parallel]\npp = 16\ndp = 64\nep = 64\nzero = 1\n"
        '[train]\nmicro_batch_size = 1\nrecompute = "full"\n'
    )
    steps = {}
    for imbalance in ("1.0", "2.0"):
        out = tmp_path / f"{imbalance}.json"
        result = cli("plan", str(job), "--moe-imbalance", imbalance, "--json", str(out))
        assert result.returncode == 0, result.stderr[-2000:]
        record = json.loads(out.read_text())
        assert record["query"]["moe_imbalance"] == float(imbalance)
        steps[imbalance] = record["plans"][0]["step_time_s"]
    assert steps["2.0"] > 1.2 * steps["1.0"], steps
    bad = cli("plan", str(job), "--moe-imbalance", "0.5")
    assert bad.returncode == 2 and "--moe-imbalance" in bad.stderr and "Traceback" not in bad.stderr
