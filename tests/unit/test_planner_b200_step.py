"""B200 step-time terms from public sources (issue 34, validation 6c): NVLink5's collectives
per kind from SimuMax's nccl-tests fit, and the fixed cost per call of memory-bound modules
(SimuMax's B200 default, a prior)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hyperloom.planner import launches
from hyperloom.planner import measured_b200 as mb
from hyperloom.planner.collectives import all_to_all_cost, collective_time, group_link
from hyperloom.planner.hardware import Cluster
from hyperloom.planner.profiles import B200, H100
from hyperloom.planner.published_memory import SIMUMAX_RUNTIME, simumax_model
from hyperloom.planner.simulate import predict
from hyperloom.planner.strategy import Strategy

GIB = 1024**3
# one TP collective's full buffer of Llama 3 70B at 4,096 tokens: b x s x h BF16
BUF = 4096 * 8192 * 2.0


def _fit(kind: str, n: int, nbytes: float) -> float:
    """SimuMax's `compute_net_op_time` on its B200 fit, written out: fixed + steps x latency
    + bytes x scale (n-1)/n / (eff x 900 GiB/s)."""
    eff, step_us, fixed_us = mb.NCCL_FIT[kind]
    scale = 2 if kind == "all_reduce" else 1
    beta = nbytes * scale * (n - 1) / n / (eff * 900 * GIB)
    return beta + (step_us * scale * (n - 1) + fixed_us) * 1e-6


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_b200_collectives_follow_the_measured_nccl_fit_per_kind(kind, n):
    """Before: every kind at the all-reduce's bus efficiency of 900 GB/s (not GiB/s) and a
    1.5 us step, so tp8's all-gather of 64 MiB cost 98 us against the fit's 178."""
    link = group_link(Cluster.of("b200", 8), n, 1)
    assert collective_time(kind, n, BUF, link) == pytest.approx(_fit(kind, n, BUF), rel=1e-9)


def test_b200_expert_all_to_all_follows_the_fit():
    a2a = all_to_all_cost(Cluster.of("b200", 8), 8)
    assert a2a.time(1e8) == pytest.approx(_fit("all_to_all", 8, 1e8), rel=1e-9)


def test_memory_bound_calls_per_layer_as_megatron_te_runs_them():
    """Llama: two norms and SwiGLU each way, the norms' weight gradients; DeepSeek-V2 cut to
    4 layers (1 dense): 4 norms, the activation(s), and in the 3 MoE layers router, permute
    and un-permute."""
    assert launches.layer_calls(simumax_model("llama3-70b", 12)) == (3.0, 3.0, 2.0)
    f, b, w = launches.layer_calls(simumax_model("deepseek-v2", 4))
    wm = 0.75
    assert f == b == pytest.approx(4 + (1 - wm) + 2 * wm + 3 * wm)
    assert w == pytest.approx(4 + wm)
    assert launches.layer_phase(simumax_model("llama3-70b", 12), H100).total == 0.0


def test_b200_step_pays_each_call_latency_once_per_layer_and_micro_batch():
    """Before: no fixed cost, so tp8's 512-token norms cost their bytes (about 2 us each).
    A 12-layer Llama 3 70B at tp8, 4 micro-batches, 1F1B at pp 1: the step grows by 12 x 4
    layers x 8 calls + 4 heads x 5 calls, at 30 us each, exactly (no overlap at pp 1)."""
    spec, s = simumax_model("llama3-70b", 12), Strategy(tp=8, zero=1, microbatches=4)
    plan = predict(spec, Cluster.of("b200", 8), s, 4096, SIMUMAX_RUNTIME, fast=False)
    none = replace(B200, kernel_latency_us=0.0)
    base = predict(spec, Cluster(none, 8), s, 4096, SIMUMAX_RUNTIME, fast=False)
    calls = 12 * 4 * 8 + 4 * 5
    assert B200.kernel_latency_us == mb.KERNEL_LATENCY_US == 30.0
    assert plan.step_time - base.step_time == pytest.approx(calls * 30e-6, rel=1e-6)


def test_megatron_embedding_gradient_is_the_whole_table_each_micro_batch():
    """Megatron's embedding backward forms a dense BF16 gradient of the rank's vocab / tp
    rows and its DDP hook adds it to the FP32 main_grad: 12 B per table element per
    micro-batch, whatever the tokens. Before: only the tokens' rows (3 x 2 B x tokens x dim),
    0.2 ms instead of 1.9 for Llama 3 405B's 64,128 x 16,384 slice at tp2."""
    from hyperloom.planner.costs import embedding_phase, links_for
    from hyperloom.planner.strategy import RUNTIMES

    spec, s, cluster = simumax_model("llama3-405b", 4), Strategy(tp=2, dp=4), Cluster.of("b200", 8)
    links = links_for(cluster, s, spec)
    meg = embedding_phase(spec, s, 4096, B200, links, SIMUMAX_RUNTIME)
    ours = embedding_phase(spec, s, 4096, B200, links, RUNTIMES["hyperloom"])
    table = 12.0 * 128256 / 2 * 16384
    assert meg.w - ours.w == pytest.approx(B200.memory_time(table), rel=1e-9)
    assert meg.w > 1.5e-3 and meg.f == ours.f


def test_deepseek_dense_layers_lead_in_the_time_model_too():
    """DeepSeek-V2 cut to 4 layers (the first dense) at pp 2: the last stage runs two MoE
    layers and the head, the first the dense layer, an MoE layer and the embedding. Before:
    every chunk ran two mean layers (0.25 dense), which made the busier last stage 5% light."""
    from hyperloom.planner.simulate import _layer, prepare

    spec, cluster = simumax_model("deepseek-v2", 4), Cluster.of("b200", 8)
    s = Strategy(tp=1, pp=2, dp=4, ep=4, zero=1, microbatches=8)
    prep = prepare(spec, cluster, s, 4096, SIMUMAX_RUNTIME)
    key = replace(s, microbatches=1)
    dense = _layer(spec.with_config(n_dense_layers=4), cluster, SIMUMAX_RUNTIME, 4096, key)[1]
    moe = _layer(spec.with_config(n_dense_layers=0), cluster, SIMUMAX_RUNTIME, 4096, key)[1]
    emb, head = prep.ends
    assert prep.f[0] == pytest.approx(dense.f + moe.f + emb.f, rel=1e-12)
    assert prep.f[1] == pytest.approx(2 * moe.f + head.f, rel=1e-12)
    assert prep.b[1] + prep.w[1] == pytest.approx(2 * (moe.b + moe.w) + head.b + head.w)
    assert moe.total > 1.3 * dense.total  # so the mean layer under-costed the last stage


def test_frozen_weights_make_no_weight_gradient_calls():
    spec = simumax_model("llama3-70b", 12)
    train, frozen = launches.layer_phase(spec, B200), launches.layer_phase(spec, B200, False)
    assert train.w == pytest.approx(2 * 30e-6) and frozen.w == 0.0 and frozen.f == train.f
    assert launches.head_phase(B200, False).w == 0.0
