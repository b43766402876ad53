"""A vision-language model trains alike in every layout (gloo workers on CPU).

A small `vlm-tiny` trains 5 steps on the built-in scenes set with the same global batch of 8
samples -- rows holding one image, two or none, answers of different lengths -- as one
process, under tp 2 (with and without sequence parallelism), pp 2 (1F1B, two micro-batches)
and dp 2 with ZeRO-1 and with FSDP2; losses and gradient norms agree to a relative 1e-5 (fp32). The sample-mean loss is
what makes the split layouts equal: a token mean per micro-batch would weigh samples by
their micro-batch's answer lengths. The encoder's last block (above the feature layer) and
its final LayerNorm take no part and are frozen, which DDP and ZeRO-1 must tolerate.
Also here: training stages freeze what they say (no gradients, no optimizer state) and a
resumed run equals an uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_VLM, override_args

from hyperloom import checkpoint as ckpt
from hyperloom.config import config_from_dict, read_toml
from hyperloom.models.registry import init_model

STEPS = 5
GLOBAL_BATCH = 8
JOB = {
    **TINY_VLM,
    "data__scene_samples": 256,
    "train__steps": STEPS,
    "train__warmup_steps": 2,
    "train__eval_batches": 2,
    "logging__eval_answers": 0,
}
LAYOUTS = {
    "tp2": dict(parallel__tp=2, train__micro_batch_size=8),
    "tp2-sp": dict(parallel__tp=2, parallel__sp=True, train__micro_batch_size=8),
    "pp2": dict(parallel__pp=2, parallel__microbatches=2, train__micro_batch_size=4),
    "dp2-zero1": dict(parallel__dp=2, parallel__zero=1, train__micro_batch_size=4),
    "dp2-fsdp2": dict(parallel__dp=2, parallel__zero=3, train__micro_batch_size=4),
}


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


@pytest.fixture(scope="module")
def runs(tiny_job_args, jobs_train, tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm")
    job = tiny_job_args(out / "unused", **JOB)
    one = [
        ("ref", override_args(train__micro_batch_size=GLOBAL_BATCH)),
        ("split", override_args(train__micro_batch_size=GLOBAL_BATCH, train__stop_at_step=3)),
        ("split", override_args(train__micro_batch_size=GLOBAL_BATCH)),
        (
            "align",
            override_args(train__micro_batch_size=GLOBAL_BATCH)
            + ["--train.freeze", '["vision", "decoder"]'],
        ),
        (
            "tune",
            override_args(train__micro_batch_size=GLOBAL_BATCH)
            + ["--train.freeze", '["vision"]', "--checkpoint.init_from", str(out / "w1" / "align")],
        ),
    ]
    single = jobs_train(out / "w1", 1, job, one)
    assert single.returncode == 0, single.stderr[-4000:]
    cases = [(name, override_args(**kw)) for name, kw in LAYOUTS.items()]
    two = jobs_train(out / "w2", 2, job, cases)
    assert two.returncode == 0, two.stderr[-4000:]
    return out


def assert_same_training(reference: Path, other: Path) -> None:
    """Losses and gradient norms of every step within a relative 1e-5."""
    ref = {r["step"]: r for r in read_metrics(reference)}
    got = {r["step"]: r for r in read_metrics(other)}
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "grad_norm"):
            a, b = ref[step][key], got[step][key]
            assert abs(a - b) <= 1e-5 * abs(a), f"{other.name} step {step} {key}: {a} vs {b}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(runs, layout):
    assert_same_training(runs / "w1" / "ref", runs / "w2" / layout)


def test_resume_is_bitwise(runs):
    ref = ckpt.load_model_state(ckpt.resolve_checkpoint(runs / "w1" / "ref"))
    split = ckpt.load_model_state(ckpt.resolve_checkpoint(runs / "w1" / "split"))
    assert ref.keys() == split.keys()
    for name in ref:
        assert torch.equal(ref[name], split[name]), name
    a = [r["loss"] for r in read_metrics(runs / "w1" / "ref")]
    b = [r["loss"] for r in read_metrics(runs / "w1" / "split")]
    assert a == b


def test_projector_alignment_trains_the_projector_alone(runs):
    """train.freeze = [vision, decoder]: only projector weights move, and only they have
    optimizer state; the unused encoder block never has any."""
    path = ckpt.resolve_checkpoint(runs / "w1" / "align")
    after = ckpt.load_model_state(path)
    state = ckpt.load_train_state(path)
    # the weights at step 0 are the seed's: rebuild them

    raw = read_toml(path / "config.toml")  # the weights at step 0 are the seed's
    raw.pop("parallel", None)
    cfg = config_from_dict(raw, world_size=1)
    start = init_model(cfg.model, "cpu", cfg.train.seed).state_dict()
    moved = {n for n in after if not torch.equal(after[n], start[n])}
    assert moved and all(n.startswith("projector.") for n in moved), sorted(moved)[:5]
    assert {n for n in start if n.startswith("projector.")} == moved
    assert set(state["optimizer"]["state"]) == moved


def test_second_stage_starts_from_the_first_stages_weights(runs):
    """checkpoint.init_from: stage 2 (projector and decoder train) starts from stage 1's
    result -- its step-0 validation loss is stage 1's final one -- with fresh optimizer
    state and step 0."""
    align = json.loads((runs / "w1" / "align" / "summary.json").read_text())
    tune = json.loads((runs / "w1" / "tune" / "summary.json").read_text())
    assert tune["initialised_from"]["kept_fresh"] == 0
    assert tune["initialised_from"]["loaded"] > 0
    assert tune["initial_val_loss"] == align["final_val_loss"]
    assert tune["steps_this_run"] == STEPS


# Four ranks: tensor x pipeline parallelism, and the schedules whose first stage is not where
# the plain one is (ZB-V's V shape; DualPipe holds the first stage on both ends of the pipe,
# each copy fed images). Four blocks, so that every one of the four chunks holds one.
WORLD4 = {
    "tp2-pp2-sp": dict(parallel__tp=2, parallel__sp=True, parallel__pp=2,
                       parallel__microbatches=2, train__micro_batch_size=4),
    "pp2-dp2-zbv": dict(parallel__pp=2, parallel__dp=2, parallel__pp_schedule="zb-v",
                        parallel__microbatches=4, train__micro_batch_size=1),
    "pp2-dp2-dualpipe": dict(parallel__pp=2, parallel__dp=2, parallel__pp_schedule="dualpipe",
                             parallel__microbatches=4, train__micro_batch_size=1),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs4(tiny_job_args, jobs_train, tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm4")
    job = tiny_job_args(out / "unused", **{**JOB, "model__n_layers": 4})
    ref = [("ref", override_args(train__micro_batch_size=GLOBAL_BATCH))]
    single = jobs_train(out / "w1", 1, job, ref)
    assert single.returncode == 0, single.stderr[-4000:]
    four = jobs_train(out / "w4", 4, job, [(n, override_args(**kw)) for n, kw in WORLD4.items()])
    assert four.returncode == 0, four.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(WORLD4))
def test_four_rank_layout_equals_one_process(runs4, layout):
    assert_same_training(runs4 / "w1" / "ref", runs4 / "w4" / layout)
