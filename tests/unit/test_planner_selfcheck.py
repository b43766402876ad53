"""The training self-check's CPU rules: measured collective factors on the link, and ranks
that oversubscribe the cores bounded by the machine's total work."""

from __future__ import annotations

import dataclasses

import pytest

from hyperloom.config import load_config, preset_config
from hyperloom.planner import predict
from hyperloom.planner.collectives import Link, collective_time, group_link
from hyperloom.planner.hardware import PROFILES, Cluster
from hyperloom.planner.model import ModelSpec
from hyperloom.planner.selfcheck import cpu_share, oversubscribed_step, self_check
from hyperloom.planner.strategy import Strategy

CPU = dataclasses.replace(
    PROFILES["h100"],
    name="calibrated-cpu",
    bf16_tflops=0.4,
    hbm_gbs=40.0,
    intra_gbs=2.0,
    intra_latency_us=100.0,
    gpus_per_node=2,
    intra_tier="",  # a calibrated CPU profile: plain rings with measured factors
    inter_tier="",
)


def test_collective_scale_multiplies_only_its_kind_s_bandwidth_term():
    ring = Link(1e9, 1e-4)
    gloo = Link(1e9, 1e-4, scale=(("reduce_scatter", 3.0),))
    s = 64e6
    assert collective_time("all_reduce", 2, s, gloo) == collective_time("all_reduce", 2, s, ring)
    rs_ring, rs_gloo = (collective_time("reduce_scatter", 2, s, k) for k in (ring, gloo))
    assert rs_gloo - 1e-4 == pytest.approx(3.0 * (rs_ring - 1e-4))  # latency untouched
    acc = dataclasses.replace(CPU, collective_scale=(("all_gather", 2.0),))
    assert group_link(Cluster(acc, 2, 2), 2, 1).scale == (("all_gather", 2.0),)


def test_cpu_share_is_a_rank_s_threads_at_most_the_machine():
    assert cpu_share(1, 4, cores=2) == 0.5  # four one-thread ranks: each runs on a core
    assert cpu_share(2, 1, cores=2) == 1.0
    assert cpu_share(8, 1, cores=2) == 1.0


def test_oversubscribed_ranks_are_bounded_by_the_machine_s_work():
    spec = ModelSpec.from_model_config(preset_config("tiny"))
    pp2dp2 = Strategy(pp=2, dp=2, mbs=2, microbatches=2)
    acc = dataclasses.replace(CPU, bf16_tflops=CPU.bf16_tflops * 0.5, hbm_gbs=CPU.hbm_gbs * 0.5)
    plan = predict(spec, Cluster(acc, 4, 2), pp2dp2, 256, margin_gib=0)
    parts = plan.rank_breakdown
    assert len(parts) == 2  # one per pipeline rank
    busy = sum(
        p["compute"] + p["tp_comm"] + p["dp_sync_total"] + p["optimizer"] + p["recompute"]
        for p in parts
    )
    # four ranks wanting half the machine each: the two pipeline ranks' work, twice (dp),
    # on a machine that does one rank-second per half second
    got = oversubscribed_step(plan, ranks_here=4, demand_share=0.5)
    assert got == pytest.approx(max(plan.step_time, busy * 4 / 2 * 0.5))
    assert got > plan.step_time  # two cores cannot run four busy ranks at full speed
    # the old fixed split (a quarter of the machine each, bubbles included) predicts more:
    # an idle rank's core serves another rank
    quarter = dataclasses.replace(CPU, bf16_tflops=CPU.bf16_tflops / 4, hbm_gbs=CPU.hbm_gbs / 4)
    fixed = predict(spec, Cluster(quarter, 4, 2), pp2dp2, 256, margin_gib=0).step_time
    assert got < fixed


def test_self_check_applies_the_bound_only_when_the_cores_are_oversubscribed():
    job = load_config(
        None,
        ["--parallel.pp", "2", "--parallel.dp", "2", "--train.micro_batch_size", "2"]
        + ["--parallel.microbatches", "2"],
        world_size=4,
    )
    over = self_check(job, CPU, 4, 1.0, 1e9, compute_share=0.5, ranks_here=4)
    fits = self_check(job, CPU, 4, 1.0, 1e9, compute_share=0.5, ranks_here=2)
    assert over["predicted_step_s"] > fits["predicted_step_s"]
    assert over["step_time_error"] == pytest.approx(over["predicted_step_s"] - 1.0)


def test_layer_overhead_is_host_time_added_per_layer_and_micro_batch():
    from hyperloom.planner.costs import layer_phase, links_for
    from hyperloom.planner.model import build_layer
    from hyperloom.planner.strategy import job_runtime

    spec = ModelSpec.from_model_config(preset_config("tiny"))
    s = Strategy(mbs=8)
    layer = build_layer(spec, 8, 256, 1, 1, False)
    rt = job_runtime()
    links = links_for(Cluster(CPU, 1, 1), s)
    plain = layer_phase(layer, spec, s, CPU, links, rt)
    host = layer_phase(layer, spec, s, dataclasses.replace(CPU, layer_overhead_s=0.003), links, rt)
    assert host.f - plain.f == pytest.approx(0.001) and host.b - plain.b == pytest.approx(0.002)
    assert host.w == plain.w and host.compute - plain.compute == pytest.approx(0.003)


def test_zero1_on_cpu_is_costed_as_the_runtime_runs_it():
    # On gloo, ZeRO-1 all-reduces the gradients and the FP32 weights in place
    # (`parallel/zero1.py`); elsewhere it reduce-scatters and all-gathers.
    from hyperloom.planner.costs import dp_sync, links_for
    from hyperloom.planner.selfcheck import cpu_runtime
    from hyperloom.planner.strategy import RUNTIMES

    gloo = dataclasses.replace(CPU, collective_scale=(("reduce_scatter", 4.0),))
    s = Strategy(dp=2, zero=1, microbatches=1)
    links = links_for(Cluster(gloo, 2, 2), s)
    n = 22e6
    rt = RUNTIMES["hyperloom"]
    total, _ = dp_sync(n, 1.0, 1.0, s, links, cpu_runtime(rt))
    ar = collective_time("all_reduce", 2, 4 * n, links.dp)
    assert total == pytest.approx(2 * ar)
    total, _ = dp_sync(n, 1.0, 1.0, s, links, rt)
    rs = collective_time("reduce_scatter", 2, 4 * n, links.dp)
    ag = collective_time("all_gather", 2, rt.param_gather_bytes * n, links.dp)
    assert total == pytest.approx(rs + ag) and rs + ag > 2 * ar  # gloo's slow reduce-scatter


def test_memory_parts_are_those_of_the_rank_whose_peak_is_compared():
    # GPipe on two stages: the last stage (head, loss) peaks above the first
    job = load_config(
        None,
        ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe", "--train.micro_batch_size", "2"]
        + ["--parallel.microbatches", "4"],
        world_size=2,
    )
    out = self_check(job, CPU, 2, None, None)
    parts = out["predicted_memory_gib_by_part"]
    assert out["predicted_memory_rank"] == 1
    assert parts["peak"] * 2**30 / 1e9 == pytest.approx(out["predicted_peak_memory_gb"], rel=1e-3)
