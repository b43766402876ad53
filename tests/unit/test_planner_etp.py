"""Expert tensor parallelism in the planner (`Strategy.etp`, `parallel.etp`): the routed
experts' width split over etp ranks of each tp group, 0 = over tp (the Megatron layout the
planner modelled before etp), 1 = replicated over tp (hyperloom's default)."""

from __future__ import annotations

import dataclasses

import pytest

from hyperloom.config import load_config, preset_config
from hyperloom.planner.collectives import collective_time
from hyperloom.planner.costs import dp_sync, expert_parallel_comm, layer_phase, links_for
from hyperloom.planner.hardware import Cluster, get_profile
from hyperloom.planner.model import ModelSpec, build_layer
from hyperloom.planner.search import SearchSpace, candidates, search
from hyperloom.planner.simulate import predict
from hyperloom.planner.strategy import RUNTIMES, Strategy, check

LITE = ModelSpec.from_model_config(preset_config("deepseek-v2-lite"), "deepseek-v2-lite")
TINY = ModelSpec.from_model_config(preset_config("moe-tiny"), "moe-tiny")
H100 = get_profile("h100")
SEQ = 4096


def _numbers(plan) -> tuple:
    return (
        plan.step_time,
        plan.peak_memory,
        tuple(sorted(plan.breakdown.items())),
        tuple(dataclasses.astuple(m) for m in plan.memory),
    )


def _experts_time(spec: ModelSpec, s: Strategy) -> float:
    """Forward seconds of the mean layer's routed-expert GEMMs on one rank."""
    layer = build_layer(spec, s.mbs, SEQ, s.tp, s.cp, s.sp, True, s.ep, etp=s.etp)
    return sum(
        H100.gemm_time(g.m, g.n, g.k, False, g.count)
        for g in layer.gemms
        if g.name.startswith("experts_")
    )


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("runtime", ["hyperloom", "megatron"])
def test_etp_equal_to_tp_is_the_etp_unset_prediction(ep, runtime):
    """etp = tp (with sp, Megatron's layout) is exactly what the planner predicted before
    etp existed, so published validations keep their numbers."""
    base = Strategy(tp=4, pp=2, dp=4, ep=ep, zero=1, mbs=1, microbatches=8, recompute="full")
    cluster = Cluster(H100, base.world)
    unset = predict(LITE, cluster, base, SEQ, runtime)
    split = predict(LITE, cluster, dataclasses.replace(base, etp=4), SEQ, runtime)
    assert _numbers(split) == _numbers(unset)
    assert "etp4" in split.strategy.label() and "etp" not in unset.strategy.label()


def test_etp_1_replicates_the_experts_over_tp():
    """etp = 1 at tp = 4 without sp: every tp rank routes all the tokens through full-width
    experts, about 4x the expert GEMM time of etp = 4 and 4x their parameters, and no etp
    communication (etp = 4 all-reduces the routed rows' partial outputs over tp)."""
    one = Strategy(tp=4, dp=2, mbs=1, microbatches=4, sp=False, etp=1, recompute="full")
    four = dataclasses.replace(one, etp=4)
    flops = [
        sum(
            g.flops
            for g in build_layer(LITE, 1, SEQ, 4, 1, False, etp=e).gemms
            if "experts_" in g.name
        )
        for e in (1, 4)
    ]
    assert flops[0] == pytest.approx(4 * flops[1], rel=1e-12)
    ratio = _experts_time(LITE, one) / _experts_time(LITE, four)
    assert 3 < ratio <= 4  # the wider GEMMs run a little more efficiently
    cluster = Cluster(H100, one.world)
    p1 = predict(LITE, cluster, one, SEQ, "megatron")
    p4 = predict(LITE, cluster, four, SEQ, "megatron")
    assert p1.breakdown["compute"] > p4.breakdown["compute"]
    assert p1.memory[0].params > p4.memory[0].params
    assert p1.peak_memory > p4.peak_memory
    # the expert states: the whole routed bank per rank instead of a quarter
    expert_params = LITE.n_moe_layers * LITE.routed_expert_params() + LITE.mtp_expert_params()
    gap = p1.memory[0].params - p4.memory[0].params
    assert gap == pytest.approx(2 * expert_params * (1 - 1 / 4), rel=1e-9)  # BF16 params
    assert "ep_comm" not in p1.breakdown and p4.breakdown["ep_comm"] > 0


def test_etp_2_at_tp_4_counts_the_etp_all_reduce():
    """Without sp: one all-reduce of the routed rows over the etp group each way, at ep = 1
    too, on the group's own link."""
    s = Strategy(tp=4, dp=2, sp=False, etp=2)
    cluster = Cluster(H100, s.world)
    rt = RUNTIMES["megatron"]
    layer = build_layer(LITE, 1, SEQ, 4, 1, False, True, 1, etp=2)
    links = links_for(cluster, s, LITE)
    assert links.etp is not None
    fwd, bwd = expert_parallel_comm(layer, LITE, s, links, rt)
    rows = 2.0 * SEQ * LITE.moe_top_k * LITE.dim  # every token's routed rows, BF16
    one = collective_time("all_reduce", 2, rows, links.etp)
    assert fwd == bwd == pytest.approx(layer.moe_fraction * one, rel=1e-12)
    assert layer_phase(layer, LITE, s, H100, links, rt).ep_comm > 0
    # the expert GEMMs are half the width of etp = 4's, on the same rows
    four = build_layer(LITE, 1, SEQ, 4, 1, False, True, 1, etp=4)
    g2 = {g.name: g for g in layer.gemms}
    g4 = {g.name: g for g in four.gemms}
    assert (
        g2["experts_fc2"].k == 2 * g4["experts_fc2"].k
        and g2["experts_fc2"].m == g4["experts_fc2"].m
    )


def test_etp_with_sp_gathers_the_etp_groups_slices():
    """With sp the rank routes its 1/tp slice, gathered over etp: etp = 1 takes a quarter of
    the rows of etp = 4 at tp = 4, through experts four times as wide; at ep > 1 the etp
    group's gather and reduce-scatter run over etp ranks. The weight gradients of the etp
    slices are summed over the tp / etp ranks that hold them (`dp_sync`)."""
    layer1 = build_layer(LITE, 1, SEQ, 4, 1, True, True, 1, etp=1)
    layer4 = build_layer(LITE, 1, SEQ, 4, 1, True, True, 1, etp=4)
    assert layer1.routed_elements * 4 == pytest.approx(layer4.routed_elements, rel=1e-12)
    s = Strategy(tp=4, dp=2, ep=2, etp=2)
    cluster = Cluster(H100, s.world)
    rt = RUNTIMES["hyperloom"]
    links = links_for(cluster, s, LITE)
    layer = build_layer(LITE, 1, SEQ, 4, 1, True, True, 2, etp=2)
    fwd, _ = expert_parallel_comm(layer, LITE, s, links, rt)
    no_etp = expert_parallel_comm(layer, LITE, dataclasses.replace(s, etp=1), links, rt)[0]
    copies = layer.dispatch_bytes * LITE.moe_imbalance
    gather = collective_time("all_gather", 2, 2 * copies, links.etp)
    gather += collective_time("reduce_scatter", 2, 2 * copies, links.etp)
    assert fwd - no_etp == pytest.approx(layer.moe_fraction * gather, rel=1e-12)
    # the etp slices' gradients: an all-reduce over tp / etp = 2 ranks, not hidden
    base = dp_sync(1e8, 1.0, 1.0, s, links, rt, 2e7)
    more = dp_sync(1e8, 1.0, 1.0, s, links, rt, 2e7, 3e7)
    extra = collective_time("all_reduce", 2, rt.grad_bytes * 3e7, links.etp_rep)
    assert more[0] - base[0] == pytest.approx(extra) and more[1] - base[1] == pytest.approx(extra)
    # under FSDP2 the summed gradients are the shards over the experts' dp x cp / ep = 1
    # replicas here; at ep = 1 over dp = 2 (`ParallelModel.finish_grads`)
    for ep, shards in ((2, 1), (1, 2)):
        z3 = dataclasses.replace(s, zero=3, ep=ep)
        got = (
            dp_sync(1e8, 1.0, 1.0, z3, links, rt, 0.0, 3e7)[0]
            - dp_sync(1e8, 1.0, 1.0, z3, links, rt)[0]
        )
        want = collective_time("all_reduce", 2, rt.grad_bytes * 3e7 / shards, links.etp_rep)
        assert got == pytest.approx(want), ep
    plan = predict(LITE, cluster, dataclasses.replace(s, mbs=1, microbatches=4), SEQ)
    assert plan.step_time > 0


def test_strategy_from_job_reads_parallel_etp():
    moe = ["--model.preset=moe-tiny", "--data.seq_len=256", "--parallel.tp=2"]
    assert Strategy.from_job(load_config(None, moe, world_size=2)).etp == 1  # the default
    job = load_config(None, [*moe, "--parallel.etp=2"], world_size=2)
    s = Strategy.from_job(job)
    assert s.etp == 2 and "etp2" in s.label()
    # a dense model has no experts to split: left unset
    assert Strategy.from_job(load_config(None, ["--parallel.tp=2"], world_size=2)).etp == 0


def test_check_explains_bad_etp():
    assert "etp (3) must divide tp (4)" in check(Strategy(tp=4, etp=3), TINY, 256)
    dense = ModelSpec.from_model_config(preset_config("llama3-8b"), "llama3-8b")
    assert "no experts" in check(Strategy(tp=2, etp=2), dense, 256)
    assert check(Strategy(tp=2, etp=1), dense, 256) is None  # a job's default, harmless
    odd = TINY.with_config(moe_ffn_dim=5, n_shared_experts=4)
    assert check(Strategy(tp=4, etp=2, sp=False), odd, 256) == (
        "moe_ffn_dim (5) must divide by etp (2)"
    )
    assert check(Strategy(tp=4, etp=1, sp=False), odd, 256) is None  # whole experts
    # the shared experts still split over tp
    assert "n_shared_experts * moe_ffn_dim (5) must divide by tp (4)" in check(
        Strategy(tp=4, etp=1, sp=False), odd.with_config(n_shared_experts=1), 256
    )
    assert check(Strategy(tp=4, etp=2), TINY, 256) is None
    assert "etp must be >= 0" in check(Strategy(tp=2, etp=-1), TINY, 256)


def test_search_tries_both_etp_values():
    space = SearchSpace(tp=(2,), cp=(1,), pp=(1,), mbs=(1,), zero=(0,), recompute=("full",))
    space = dataclasses.replace(space, fp8=(False,))
    points = list(candidates(TINY, 4, 4, space, False))
    assert {p.etp for p in points} == {0, 1}
    assert {p.etp for p in candidates(TINY, 4, 4, space.fixed(etp=2), False)} == {2}
    dense = ModelSpec.from_model_config(preset_config("llama3-8b"), "llama3-8b")
    assert {p.etp for p in candidates(dense, 4, 4, space, False)} == {0}
    result = search(TINY, Cluster(H100, 4), 4, 256, space=space, top_k=50)
    assert {p.strategy.etp for p in result.top} == {0, 1}
