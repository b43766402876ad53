"""`train.recompute = auto` (hyperloom.planner.autorecompute): per pipeline stage the policy
with the least predicted recompute whose predicted peak fits the budget; `hyperloom plan`
shows the same choice; a budget nothing fits is one clear error; and a run under auto is the
run of the policy it chose (bitwise equal to no recompute, as every policy is)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hyperloom.accelerator import Accelerator
from hyperloom.config import RECOMPUTE_CANDIDATES, ConfigError, load_config
from hyperloom.parallel.recompute import apply_recompute
from hyperloom.planner import PlanError
from hyperloom.planner.autorecompute import counted_peak, for_job
from hyperloom.planner.hardware import HardwareProfile
from hyperloom.planner.selfcheck import job_plan
from hyperloom.train.trainer import Trainer

PROFILE = HardwareProfile("test-device", 1.0, 0.0, 80.0, 100.0, 1.0)  # memory as reserved


def job(tmp: str | Path, tiny_job_args, **overrides):
    return load_config(None, tiny_job_args(tmp, **overrides))


def peaks(cfg, policy: str, world: int = 1) -> list[float]:
    plan = job_plan(cfg, PROFILE, world, recompute=policy)
    return [counted_peak(m, PROFILE) for m in plan.memory]


def recompute_s(cfg, policy: str, stage: int = 0, world: int = 1) -> float:
    plan = job_plan(cfg, PROFILE, world, recompute=policy)
    return plan.rank_breakdown[stage].get("recompute", 0.0)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"train__recompute": "auto", "train__recompute_layers": 1}, "recompute_layers = 0"),
        ({"train__recompute": "full", "train__memory_budget_gb": 2}, "auto only"),
        ({"train__recompute": "auto", "train__memory_budget_gb": -1}, "memory_budget_gb must"),
    ],
)
def test_auto_config_errors(tmp_path, tiny_job_args, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        job(tmp_path, tiny_job_args, **overrides)


def test_auto_takes_no_recompute_when_it_fits(tmp_path, tiny_job_args):
    cfg = job(tmp_path, tiny_job_args, data__seq_len=64)
    choice = for_job(cfg, PROFILE, 1, 1e12)
    assert choice.policies == ("none",)
    assert choice.recompute_s == (0.0,)


def test_auto_takes_the_least_recompute_that_fits(tmp_path, tiny_job_args):
    """Between the full and no-recompute peaks: a fitting policy, none fitting with less
    predicted recompute; the policies' recompute costs order as RECOMPUTE_CANDIDATES says."""
    cfg = job(tmp_path, tiny_job_args, model__n_layers=4)
    full, none = peaks(cfg, "full")[0], peaks(cfg, "none")[0]
    assert full < none
    # Llama has no routed experts and no MLA: those modules free and cost nothing there
    dense = [p for p in RECOMPUTE_CANDIDATES if "experts" not in p and "mla_up" not in p]
    costs = [recompute_s(cfg, p) for p in dense]
    assert costs == sorted(costs) and costs[0] == 0 < costs[1], costs
    for module in ("experts", "mla_up"):
        assert recompute_s(cfg, module) == 0 and peaks(cfg, module) == peaks(cfg, "none")
    for budget in (full + 0.25 * (none - full), full + 0.75 * (none - full)):
        choice = for_job(cfg, PROFILE, 1, budget)
        (policy,) = choice.policies
        assert choice.peaks[0] <= budget and policy != "none"
        for other in RECOMPUTE_CANDIDATES:
            if peaks(cfg, other)[0] <= budget:
                assert recompute_s(cfg, other) >= choice.recompute_s[0], (other, policy)
        assert choice.candidates["full"]["peak_gb_by_stage"] == [round(full / 1e9, 4)]


def test_auto_counts_what_the_rank_already_holds(tmp_path, tiny_job_args):
    cfg = job(tmp_path, tiny_job_args, model__n_layers=4)
    none = peaks(cfg, "none")[0]
    assert for_job(cfg, PROFILE, 1, none * 1.01).policies == ("none",)
    assert for_job(cfg, PROFILE, 1, none * 1.01, held_bytes=0.02 * none).policies != ("none",)


def test_a_budget_nothing_fits_names_the_smallest_peak(tmp_path, tiny_job_args):
    cfg = job(tmp_path, tiny_job_args, model__n_layers=4)
    full = peaks(cfg, "full")[0]
    with pytest.raises(PlanError, match=f"smallest predicted peak is {full / 1e9:.3g} GB .full"):
        for_job(cfg, PROFILE, 1, 0.9 * full)
    with pytest.raises(PlanError, match="used up before the model"):
        for_job(cfg, PROFILE, 1, 1e9, held_bytes=2e9)


def test_auto_chooses_per_pipeline_stage(tmp_path, tiny_job_args):
    """1F1B: stage 0 keeps pp micro-batches in flight, stage 1 one, so a budget between their
    no-recompute peaks recomputes on stage 0 only."""
    cfg = load_config(
        None,
        tiny_job_args(
            tmp_path,
            parallel__pp=2,
            parallel__microbatches=4,
            model__n_layers=4,
            model__vocab_size=64,
            data__seq_len=64,
        ),  # fmt: skip
        world_size=2,
    )
    none = peaks(cfg, "none", world=2)
    assert none[0] > none[1], none
    choice = for_job(cfg, PROFILE, 2, (none[0] + none[1]) / 2)
    assert choice.policies[1] == "none" and choice.policies[0] != "none", choice.policies
    assert choice.costliest == choice.policies[0]
    assert all(p <= choice.budget_bytes for p in choice.peaks)


def test_plan_shows_the_choice_the_job_runs(cli, tmp_path):
    """`hyperloom plan CONFIG` with train.recompute = auto predicts the chosen policy."""
    config = tmp_path / "job.toml"
    config.write_text('[model]\npreset = "llama3-8b"\n[data]\nseq_len = 8192\n')
    common = ["plan", str(config), "--parallel.pp", "4", "--parallel.tp", "2",
              "--train.micro_batch_size", "2", "--train.grad_accum", "8",
              "--train.recompute", "auto"]  # fmt: skip
    fits = cli(*common, "--train.memory_budget_gb", "36")
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "recompute auto, budget 36.00 GB per rank: stage 0:" in fits.stdout
    assert "stage 3: full" in fits.stdout
    tight = cli(*common, "--train.memory_budget_gb", "20")
    assert tight.returncode != 0
    assert "no recompute policy fits train.memory_budget_gb = 20" in tight.stderr
    assert "Traceback" not in tight.stderr


def _records(run_dir: Path) -> list[tuple[float, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [(r["loss"], r["grad_norm"]) for r in records if r.get("event") == "train"]


def test_the_trainer_runs_the_policy_auto_chose(tmp_path, tiny_job_args, monkeypatch):
    """Nothing held before the model (patched), a budget between the full and no-recompute
    peaks: the trainer's choice is the planner's, its blocks recompute, the summary reports
    it beside the measurement, and the run equals the run without recompute bitwise."""
    monkeypatch.setattr(Accelerator, "current_memory_bytes", lambda self: 0)
    shape = dict(model__n_layers=4, train__steps=3)
    cfg = job(tmp_path, tiny_job_args, **shape)
    full, none = peaks(cfg, "full")[0], peaks(cfg, "none")[0]
    budget = (full + 0.5 * (none - full)) / 1e9
    expected = for_job(cfg, PROFILE, 1, budget * 1e9).policies
    assert expected != ("none",)

    applied = []  # (policy, blocks that recompute) per model built

    def spy(model, policy, *args, **kwargs):
        applied.append((policy, apply_recompute(model, policy, *args, **kwargs)))
        return applied[-1][1]

    recipe = sys.modules["hyperloom.parallel.parallelize"]  # the package exports the function
    monkeypatch.setattr(recipe, "apply_recompute", spy)
    runs = {}
    for policy in ("auto", "none"):
        run_dir = Path(tempfile.mkdtemp(dir=tmp_path))
        extra = {"train__memory_budget_gb": budget} if policy == "auto" else {}
        trainer = Trainer(job(run_dir, tiny_job_args, train__recompute=policy, **shape, **extra))
        trainer.run()
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs[policy] = (_records(run_dir), weights, trainer, run_dir)
    auto = runs["auto"][2]
    assert auto.recompute_choice.policies == expected
    assert auto.run_cfg.train.recompute == expected[0]
    assert applied == [(expected[0], 4), ("none", 0)]
    summary = json.loads((runs["auto"][3] / "summary.json").read_text())["recompute_auto"]
    assert summary["policy_by_stage"] == list(expected)
    assert len(summary["measured_peak_gb_by_rank"]) == 1
    assert runs["auto"][0] == runs["none"][0]
    a, b = runs["auto"][1], runs["none"][1]
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_budget_nothing_fits_stops_the_trainer_before_training(tmp_path, tiny_job_args):
    args = tiny_job_args(tmp_path, train__recompute="auto", train__memory_budget_gb=1e-6)
    with pytest.raises(ConfigError, match="train.recompute = auto: memory budget"):
        Trainer(load_config(None, args))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_auto_is_read_as_validation_reads_it(tmp_path, tiny_job_args):
    """' AUTO ' passes validation as auto, so the trainer must choose for it too (it used to
    reach the model as a policy name and fail inside)."""
    args = tiny_job_args(tmp_path, train__recompute=" AUTO ", train__memory_budget_gb=1e3)
    trainer = Trainer(load_config(None, args))
    assert trainer.recompute_choice.policies == ("none",)
    assert trainer.run_cfg.train.recompute == "none"
