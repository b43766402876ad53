"""The planner's simulation: the schedule IR's bubble, monotonicity, extrapolation, memory."""

from __future__ import annotations

import dataclasses

import pytest

from hyperloom.config import ModelConfig, preset_config
from hyperloom.pipeline import Costs as PipeCosts
from hyperloom.pipeline import build_schedule, closed_form_bubble
from hyperloom.planner import Cluster, ModelSpec, PlanError, Strategy, predict
from hyperloom.planner.hardware import PROFILES
from hyperloom.planner.simulate import lower_bound, prepare

LLAMA8B = ModelSpec.from_model_config(preset_config("llama3-8b"))
LLAMA70B = ModelSpec.from_model_config(preset_config("llama3-70b"))
# A free, instant interconnect and a 2-token vocabulary: stages are uniform, p2p costs nothing.
IDEAL = dataclasses.replace(
    PROFILES["h100"],
    intra_gbs=1e12,
    intra_latency_us=0.0,
    nic_gbs=1e12,
    inter_latency_us=0.0,
)
UNIFORM = ModelSpec(
    ModelConfig(
        preset="uniform", n_layers=64, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        vocab_size=8,
    )
)  # fmt: skip


@pytest.mark.parametrize("pp,m", [(4, 8), (8, 16), (4, 3)])
def test_1f1b_bubble_equals_the_closed_form(pp, m):
    s = Strategy(tp=8, pp=pp, dp=1, mbs=1, microbatches=m)
    plan = predict(UNIFORM, Cluster(IDEAL, 8 * pp), s, 4096)
    prep = prepare(UNIFORM, Cluster(IDEAL, 8 * pp), s, 4096, plan.runtime)
    f, b, w = float(prep.f[1]), float(prep.b[1]), float(prep.w[1])  # a middle stage
    costs = PipeCosts(f, b, w)
    _, closed = closed_form_bubble(build_schedule("1f1b", pp, m), costs)
    # rank 0's idle time in the replay (its extra embedding work is negligible)
    assert plan.breakdown["pipeline_bubble"] == pytest.approx(closed, rel=1e-2)
    assert closed == pytest.approx((pp - 1) * (f + b + w))


def test_interleaving_shrinks_the_bubble_by_v():
    base = dict(tp=8, pp=4, dp=1, mbs=1, microbatches=8)
    one = predict(UNIFORM, Cluster(IDEAL, 32), Strategy(**base), 4096)
    two = predict(
        UNIFORM, Cluster(IDEAL, 32), Strategy(**base, schedule="interleaved", vpp=2), 4096
    )
    assert two.breakdown["pipeline_bubble"] == pytest.approx(
        one.breakdown["pipeline_bubble"] / 2, rel=0.05
    )
    assert two.step_time < one.step_time


@pytest.mark.parametrize(
    "kind,vpp", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1), ("dualpipev", 1)]
)
def test_fast_extrapolated_replay_matches_the_exact_one(kind, vpp):
    s = Strategy(
        tp=8,
        pp=4,
        dp=2,
        zero=1,
        mbs=1,
        microbatches=48,
        schedule=kind,
        vpp=vpp,
        recompute="selective",
    )
    cl = Cluster.of("h100", 64)
    exact = predict(LLAMA70B, cl, s, 8192)
    fast = predict(LLAMA70B, cl, s, 8192, fast=True)
    assert fast.simulated_microbatches < exact.simulated_microbatches == 48
    assert fast.step_time == pytest.approx(exact.step_time, rel=0.01)
    assert fast.peak_memory == pytest.approx(exact.peak_memory)
    assert lower_bound(s, prepare(LLAMA70B, cl, s, 8192, exact.runtime), cl, exact.runtime) <= (
        exact.step_time
    )


def test_more_tensor_parallelism_less_memory_per_gpu():
    peaks = []
    for tp in (1, 2, 4, 8):
        s = Strategy(tp=tp, dp=8 // tp, mbs=1, microbatches=4, zero=0)
        peaks.append(predict(LLAMA8B, Cluster.of("h100", 8), s, 8192).peak_memory)
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4


def test_recompute_trades_memory_for_time():
    plans = {
        rc: predict(
            LLAMA70B,
            Cluster.of("h100", 64),
            Strategy(tp=8, pp=4, dp=2, mbs=1, microbatches=16, recompute=rc),
            8192,
        )
        for rc in ("none", "selective", "full")
    }
    mem = [plans[rc].peak_memory for rc in ("full", "selective", "none")]
    time = [plans[rc].step_time for rc in ("none", "selective", "full")]
    assert mem == sorted(mem) and len(set(mem)) == 3
    assert time == sorted(time) and len(set(time)) == 3
    assert plans["full"].breakdown["recompute"] > plans["selective"].breakdown["recompute"] > 0


def test_in_flight_activations_come_from_the_schedule():
    """1F1B: rank r holds pp - r micro-batches; interleaving adds (p-1)/(pv) of rank 0's."""
    base = dict(tp=8, pp=4, dp=1, mbs=1, microbatches=8, recompute="full")
    cl = Cluster.of("h100", 32)
    plan = predict(UNIFORM, cl, Strategy(**base), 4096)
    acts = [m.activations for m in plan.memory]
    unit = acts[2] / 2  # the last rank's unit also holds the head's inputs
    assert [a / unit for a in acts[:3]] == pytest.approx([4, 3, 2], rel=0.01)
    assert unit < acts[3] < 2 * unit
    inter = predict(UNIFORM, cl, Strategy(**base, schedule="interleaved", vpp=2), 4096)
    assert inter.memory[0].activations / acts[0] == pytest.approx(1 + 3 / 8, rel=0.01)


def test_fp8_is_faster_and_mfu_stays_against_bf16_peak():
    s = Strategy(tp=8, pp=1, dp=8, zero=1, mbs=1, microbatches=8)
    bf16 = predict(LLAMA70B, Cluster.of("h100", 64), s, 8192)
    fp8 = predict(LLAMA70B, Cluster.of("h100", 64), dataclasses.replace(s, fp8=True), 8192)
    assert fp8.step_time < bf16.step_time and fp8.mfu > bf16.mfu
    with pytest.raises(PlanError, match="no FP8"):
        predict(LLAMA70B, Cluster.of("a100", 64), dataclasses.replace(s, fp8=True), 8192)


def test_invalid_layouts_are_user_errors_with_arithmetic():
    cl = Cluster.of("h100", 64)
    with pytest.raises(PlanError, match=r"tp\(8\) \* pp\(4\) \* dp\(4\) \* cp\(1\) = 128"):
        predict(LLAMA70B, cl, Strategy(tp=8, pp=4, dp=4), 8192)
    with pytest.raises(PlanError, match="n_kv_heads"):
        predict(LLAMA70B, Cluster.of("h100", 16), Strategy(tp=16), 8192)
    with pytest.raises(PlanError, match="interleaved needs"):
        predict(
            LLAMA70B,
            cl,
            Strategy(tp=8, pp=4, dp=2, microbatches=6, schedule="interleaved", vpp=2),
            8192,
        )
    with pytest.raises(PlanError, match="whole number"):
        Cluster.of("h100", 12)


def test_plan_json_and_breakdown_add_up():
    s = Strategy(tp=8, pp=4, dp=2, zero=1, mbs=1, microbatches=16, schedule="zb-h1")
    plan = predict(LLAMA70B, Cluster.of("h100", 64), s, 8192)
    d = plan.to_dict()
    assert d["label"] == s.label() and len(d["memory_per_rank_gib"]) == 4
    parts = {k: v for k, v in plan.breakdown.items() if k != "dp_sync_total"}
    assert sum(parts.values()) == pytest.approx(plan.step_time, rel=1e-6)
    assert plan.tokens_per_s == pytest.approx(s.global_batch * 8192 / plan.step_time)
