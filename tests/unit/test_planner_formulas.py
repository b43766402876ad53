"""Planner formulas against hand-worked numbers: model states, activations, collectives."""

from __future__ import annotations

import dataclasses

import pytest

from hyperloom.config import preset_config
from hyperloom.models.llama import accounting
from hyperloom.planner.collectives import (
    Link,
    all_to_all_time,
    collective_time,
    group_link,
    p2p_link,
    strides,
)
from hyperloom.planner.costs import assign_layers
from hyperloom.planner.errors import PlanError
from hyperloom.planner.hardware import PROFILES, Cluster, HardwareProfile, get_profile
from hyperloom.planner.memory import saved_bytes, states
from hyperloom.planner.model import ModelSpec, build_layer, parse_recompute
from hyperloom.planner.published import gpt
from hyperloom.planner.strategy import RUNTIMES, Strategy

P = 1e9  # parameters on the rank


@pytest.mark.parametrize(
    ("runtime", "zero", "bytes_per_param"),
    [
        # hyperloom: FP32 params are the master; ZeRO-1 keeps its own master slice.
        ("hyperloom", 0, 4 + 4 + 8),
        ("hyperloom", 1, 4 + 4 + 12 / 8),
        ("hyperloom", 3, 16 / 8),
        # Megatron: BF16 params, FP32 main grads, FP32 master + moments.
        ("megatron", 0, 18),
        ("megatron", 1, 6 + 12 / 8),
        ("megatron", 3, 18 / 8),
    ],
)
def test_model_state_bytes(runtime, zero, bytes_per_param):
    s = Strategy(dp=8, zero=zero, microbatches=1)
    assert sum(states(P, s, RUNTIMES[runtime])) == pytest.approx(bytes_per_param * P)


def test_fsdp_no_sync_keeps_unsharded_grads_under_accumulation():
    s = Strategy(dp=8, zero=3, microbatches=4)
    p, g, o = states(P, s, RUNTIMES["hyperloom"])
    assert (p, g, o) == pytest.approx((4 * P / 8, 4 * P, 8 * P / 8))


def test_param_dtype_bf16_gives_megatron_layout():
    rt = RUNTIMES["hyperloom"].with_param_dtype("bf16")
    assert sum(states(P, Strategy(dp=1, zero=0), rt)) == pytest.approx(18 * P)


# Korthikanti et al. Table 2 with s=2048, b=1, h=1024, a=16, t=4 (GPT, dropout, no flash).
S, B, H, A, T = 2048, 1, 1024, 16, 4
GPT = gpt("gpt", A, H, 2, 1024, dropout=True, flash_attention=False)
SBH = S * B * H
QUAD = 5 * A * S / H  # the 5as/h term


@pytest.mark.parametrize(
    ("tp", "sp", "policy", "expected"),
    [
        (1, False, "none", SBH * (34 + QUAD)),
        (T, False, "none", SBH * (10 + 24 / T + QUAD / T)),
        (T, True, "none", SBH * (34 + QUAD) / T),
        (T, True, "core_attn", 34 * SBH / T),
        (T, True, "full", 2 * SBH / T),
        (T, False, "full", 2 * SBH),
    ],
)
def test_activation_bytes_match_korthikanti(tp, sp, policy, expected):
    layer = build_layer(GPT, B, S, tp, 1, sp)
    assert saved_bytes(layer, policy) == pytest.approx(expected)


def test_llama_layer_formula_in_docstring():
    """sb[8h + 4q + 4kv + 6f]/t + 4sb*heads/t with SP and sharded inputs."""
    cfg = preset_config("llama3-70b")
    spec = ModelSpec.from_model_config(cfg)
    t, s = 8, 8192
    layer = build_layer(spec, 1, s, t, 1, True, sharded_save=True)
    h, q, kv, f = spec.dim, spec.q_dim, spec.kv_dim, spec.ffn_dim
    expected = s * (8 * h + 4 * q + 4 * kv + 6 * f) / t + 4 * s * spec.n_heads / t
    assert saved_bytes(layer, "none") == pytest.approx(expected)
    # hyperloom's runtime saves the gathered inputs of the two column-parallel GEMMs
    gathered = build_layer(spec, 1, s, t, 1, True, sharded_save=False)
    extra = 2 * (2 * s * h) * (1 - 1 / t)
    assert saved_bytes(gathered, "none") - saved_bytes(layer, "none") == pytest.approx(extra)


def test_recompute_policies_parse():
    assert parse_recompute("selective") == (False, frozenset({"core_attn", "mlp_act"}))
    assert parse_recompute("norm+mlp_act") == (False, frozenset({"norm", "mlp_act"}))
    assert parse_recompute("full")[0] is True
    with pytest.raises(PlanError, match="unknown recompute"):
        parse_recompute("attention")


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "llama3-405b", "tiny"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk-norm"])
def test_flops_and_params_agree_with_model_accounting(name, qk_norm):
    cfg = dataclasses.replace(preset_config(name), qk_norm=qk_norm)
    spec = ModelSpec.from_model_config(cfg)
    assert spec.params() == accounting.param_count(cfg)
    assert spec.model_flops_per_token(4096) == accounting.training_flops_per_token(cfg, 4096)


def test_ring_collective_times_by_hand():
    link = Link(bandwidth=100e9, latency=5e-6)
    n, size = 8, 1e9
    assert collective_time("all_reduce", n, size, link) == pytest.approx(
        2 * 7 / 8 * size / 100e9 + 2 * 7 * 5e-6
    )
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time(kind, n, size, link) == pytest.approx(
            7 / 8 * size / 100e9 + 7 * 5e-6
        )
    assert collective_time("p2p", 2, size, link) == pytest.approx(5e-6 + size / 100e9)
    assert collective_time("all_reduce", 1, size, link) == 0.0
    with pytest.raises(PlanError):
        collective_time("broadcast", n, size, link)


def test_links_follow_rank_order_and_nic_sharing():
    h100 = PROFILES["h100"]
    cl = Cluster(h100, 64, 8)
    st = strides("pp,dp,cp,tp", {"pp": 2, "dp": 4, "cp": 1, "tp": 8})
    assert st == {"tp": 1, "cp": 8, "dp": 8, "pp": 32}
    nvlink = h100.intra_gbs * 1e9 * h100.intra_eff
    nic = h100.nic_gbs * 1e9 * h100.inter_eff
    assert group_link(cl, 8, 1).bandwidth == pytest.approx(nvlink)  # tp inside a node
    dp = group_link(cl, 4, 8)  # one member per node: one NIC each
    assert (dp.level, dp.bandwidth) == ("inter", pytest.approx(nic))
    flat = group_link(cl, 16, 1)  # 8 members per node share 8 NICs, capped by NVLink
    assert flat.bandwidth == pytest.approx(min(8 * nic, nvlink))
    two = group_link(cl, 16, 4)  # 2 members per node
    assert two.bandwidth == pytest.approx(2 * nic)
    assert p2p_link(cl, 2, 32).level == "inter"
    assert p2p_link(cl, 2, 2).level == "intra"
    # all-to-all across 2 nodes: half the bytes leave through one NIC each
    a2a = all_to_all_time(cl, 16, 1e9, 1)
    assert a2a > 0.5 * 1e9 / nic


def test_gemm_efficiency_grows_with_size_and_uses_a_calibrated_table():
    h100 = PROFILES["h100"]
    small, big = h100.gemm_efficiency(256, 256, 256), h100.gemm_efficiency(8192, 8192, 8192)
    assert small < 0.1 < 0.75 < big
    # the shape model reproduces the published MAMF at the shape it was measured at
    assert h100.gemm_efficiency(6144, 17920, 2816) == pytest.approx(h100.gemm_eff)
    table = dataclasses.replace(h100, gemm_table=(((1024, 1024, 1024), 0.5),))
    # with a shape model, a measured shape wins within 5% on every dimension
    assert table.gemm_efficiency(1010, 1040, 1000) == 0.5
    assert table.gemm_efficiency(1000, 1100, 900) == pytest.approx(
        h100.gemm_efficiency(1000, 1100, 900)
    )
    flat = dataclasses.replace(table, gemm_model=None)  # a CPU profile: the nearest shape
    assert flat.gemm_efficiency(1000, 1100, 900) == 0.5
    # FP8 runs faster, but not on an accelerator without FP8 tensor cores
    assert h100.gemm_time(8192, 8192, 8192, fp8=True) < h100.gemm_time(8192, 8192, 8192)
    a100 = PROFILES["a100"]
    assert a100.gemm_time(4096, 4096, 4096, fp8=True) == a100.gemm_time(4096, 4096, 4096)


def test_profiles_roundtrip_through_json(tmp_path):
    from hyperloom.planner.hardware import save_profile

    acc = dataclasses.replace(
        PROFILES["mi300x"],
        gemm_table=(((64, 64, 64), 0.25),),
        attn_table=((256, 0.1, 0.2), (2048, 0.3, 0.4)),
        elementwise_eff=0.3,
    )
    path = save_profile(acc, tmp_path / "p.json", {"note": "x"})
    assert get_profile(str(path)) == acc
    with pytest.raises(PlanError, match="unknown accelerator"):
        get_profile("h900")
    assert set(PROFILES) >= {"h100", "h200", "a100", "b200", "mi300x", "mtt-s4000"}
    assert all(a.source for a in PROFILES.values())
    with pytest.raises(PlanError):
        HardwareProfile.from_dict({**acc.to_dict(), "bogus": 1})


def test_layers_per_chunk_balance_ranks_and_lighten_the_ends():
    std16 = tuple((r,) for r in range(16))
    assert assign_layers(126, std16) == [7] + [8] * 14 + [7]  # Llama 3 405B
    v = tuple((r, 2 * 8 - 1 - r) for r in range(8))  # V placement, 8 ranks
    counts = assign_layers(40, v)
    assert [counts[a] + counts[b] for a, b in v] == [5] * 8
    assert sum(counts) == 40


def test_calibrated_attention_by_sequence_and_elementwise_efficiency():
    base = PROFILES["h100"]
    acc = dataclasses.replace(
        base, attn_table=((256, 0.1, 0.05), (2048, 0.4, 0.2)), elementwise_eff=0.25
    )
    flops = 1e12
    peak = acc.bf16_tflops * 1e12
    # nearest sequence length (in log space) wins; no seq or no table: the scalar factors
    assert acc.attention_time(flops, seq=300) == pytest.approx(flops / (peak * 0.1))
    assert acc.attention_time(flops, backward=True, seq=1500) == pytest.approx(flops / (peak * 0.2))
    assert acc.attention_time(flops) == base.attention_time(flops)
    # without a table the attention model: slower at short rows and small heads
    short, long = (base.attention_time(flops, seq=q) for q in (256, 16384))
    assert short > 2 * long
    assert base.attention_time(flops, seq=4096, head_dim=64) > base.attention_time(
        flops, seq=4096, head_dim=128
    )
    flat = dataclasses.replace(base, attn_model=None)
    assert flat.attention_time(flops, seq=256) == flat.attention_time(flops)
    # elementwise kernels at a quarter of a copy; the copy (optimizer, collectives) unchanged
    assert acc.elementwise_time(1e9) == pytest.approx(4 * acc.memory_time(1e9))
    assert acc.memory_time(1e9) == base.memory_time(1e9)


def test_fused_head_runs_all_three_gemms_in_the_forward():
    from hyperloom.planner.costs import head_phase
    from hyperloom.planner.strategy import job_runtime

    spec = ModelSpec.from_model_config(preset_config("tiny"))
    acc, links = PROFILES["h100"], None
    s = Strategy(mbs=8)
    plain = head_phase(spec, s, 256, acc, links)
    fused = head_phase(spec, s, 256, acc, links, job_runtime(fused_cross_entropy=True))
    gemm = plain.w  # one of the head's three GEMMs
    assert fused.w == 0 and fused.f > 3 * gemm and fused.b < 0.1 * fused.f
    assert plain.compute > fused.compute  # the unfused loss moves 34 + 22 B per logit
    logits = 8 * 256 * spec.vocab_size
    # 8 B per logit and, per 256-token chunk (8 of them), a 10 B/weight cast-add of ∂W;
    # the backward scales ∂h and ∂W in place
    gemms = 8 * sum(acc.gemm_times(256, spec.vocab_size, spec.dim))  # per 256-token chunk
    assert fused.compute - gemms == pytest.approx(
        acc.elementwise_time(8.0 * logits + 4.0 * 8 * 256 * spec.dim)
        + acc.memory_time(10.0 * spec.vocab_size * spec.dim * 8)
        + acc.memory_time(8.0 * 8 * 256 * spec.dim + 8.0 * spec.vocab_size * spec.dim)
    )


def test_collective_wait_is_a_per_call_cost_inside_a_node_only():
    acc = dataclasses.replace(PROFILES["h100"], collective_wait_us=1500.0)
    cl = Cluster(acc, 16, 8)
    tp, pp, dp = group_link(cl, 2, 1), p2p_link(cl, 2, 1), group_link(cl, 2, 8)
    assert tp.fixed == pytest.approx(1.5e-3) and pp.fixed == pytest.approx(1.5e-3)
    assert dp.level == "inter" and dp.fixed == 0.0  # across nodes: NIC figures, no CPU wait
    plain = group_link(Cluster(PROFILES["h100"], 16, 8), 2, 1)
    for kind in ("all_reduce", "all_gather", "p2p"):
        extra = collective_time(kind, 2, 1e6, tp) - collective_time(kind, 2, 1e6, plain)
        assert extra == pytest.approx(1.5e-3)  # once per call, whatever the size


def test_head_under_tensor_parallel_counts_its_input_gradient_and_the_loss_all_reduces():
    from hyperloom.planner.costs import ce_chunk_tokens, head_phase, links_for
    from hyperloom.planner.strategy import job_runtime

    spec = ModelSpec.from_model_config(preset_config("tiny"))
    acc = PROFILES["h100"]
    seq, mbs, t = 256, 8, 2
    tokens = mbs * seq
    links = links_for(Cluster(acc, 2, 8), Strategy(tp=t, mbs=mbs))

    def ar(size):
        return collective_time("all_reduce", t, size, links.tp)

    fused_rt, plain_rt = job_runtime(True), job_runtime(False)
    one = head_phase(spec, Strategy(mbs=mbs), seq, acc, links, fused_rt)
    assert one.tp_comm == 0.0
    # no sp: the gradient of the FP32 norm output is all-reduced; the fused loss all-reduces
    # per chunk the row maxima (4 B) and the (sum of exponentials, target logit) pair (8 B)
    fused = head_phase(spec, Strategy(tp=t, mbs=mbs), seq, acc, links, fused_rt)
    chunk = min(tokens, ce_chunk_tokens(tokens, spec.dim, spec.vocab_size / t))
    chunks = -(-tokens // chunk)
    loss = chunks * (ar(4.0 * chunk) + ar(8.0 * chunk))
    assert fused.tp_comm == pytest.approx(ar(4.0 * tokens * spec.dim) + loss)
    # the reference loss all-reduces three FP32 values per token over the whole batch
    plain = head_phase(spec, Strategy(tp=t, mbs=mbs), seq, acc, links, plain_rt)
    assert plain.tp_comm == pytest.approx(ar(4.0 * tokens * spec.dim) + 3 * ar(4.0 * tokens))
    # sp: the FP32 input is gathered forward, its gradient reduce-scattered backward
    sp = head_phase(spec, Strategy(tp=t, sp=True, mbs=mbs), seq, acc, links, fused_rt)
    wide = 4.0 * tokens * spec.dim
    assert sp.tp_comm == pytest.approx(
        collective_time("all_gather", t, wide, links.tp)
        + collective_time("reduce_scatter", t, wide, links.tp)
        + loss
    )


def test_autocast_per_op_moves_fp32_on_the_column_parallel_side():
    from hyperloom.planner.costs import layer_phase, links_for
    from hyperloom.planner.strategy import job_runtime

    spec = ModelSpec.from_model_config(preset_config("tiny"))
    acc = PROFILES["h100"]
    s = Strategy(tp=2, sp=True, mbs=8)
    links = links_for(Cluster(acc, 2, 8), s)
    per_op, fused_autocast = job_runtime(), RUNTIMES["hyperloom"]
    assert per_op.norm_out_bytes == 4.0 and fused_autocast.norm_out_bytes == 2.0
    comm = {}
    for name, rt in (("per_op", per_op), ("bf16", fused_autocast)):
        layer = build_layer(spec, 8, 256, 2, 1, True, rt.sharded_save, 1, rt.autocast_per_op)
        comm[name] = layer_phase(layer, spec, s, acc, links, rt).tp_comm
        buf = layer.tp_buffer
    gather, scatter = (
        lambda b: collective_time("all_gather", 2, b, links.tp),
        lambda b: collective_time("reduce_scatter", 2, b, links.tp),
    )
    # attention and MLP: forward gather (FP32 under per-op autocast) + scatter (BF16), and the
    # backward's reduce-scatter of the FP32 input gradient + gather of the BF16 output gradient
    assert comm["bf16"] == pytest.approx(4 * (gather(buf) + scatter(buf)))
    assert comm["per_op"] == pytest.approx(
        2 * (gather(2 * buf) + scatter(buf)) + 2 * (scatter(2 * buf) + gather(buf))
    )


def test_shared_gradients_are_all_reduced_over_the_ranks_that_hold_them():
    from hyperloom.planner.costs import chunk_params, shared_grad_groups
    from hyperloom.planner.simulate import _rank_chunks

    spec = ModelSpec.from_model_config(preset_config("tiny"))
    tied = spec.with_config(tie_embeddings=True)
    table = spec.embedding_params() / 2

    def groups(sp, kind, pp, vpp=1):
        chunks = _rank_chunks(kind, pp, vpp)
        layers = assign_layers(sp.n_layers, chunks)
        return shared_grad_groups(sp, 2, chunks, tuple(chunk_params(sp, 2, layers))), layers

    # DualPipe: rank r and pp-1-r hold the same two chunks; every parameter is in one pair
    got, layers = groups(spec, "dualpipe", 4)
    params = chunk_params(spec, 2, layers)
    assert [r for r, _ in got] == [(0, 3), (1, 2)]
    assert [p for _, p in got] == pytest.approx([params[0] + params[3], params[1] + params[2]])
    # untied 1F1B holds every chunk once: nothing to sum
    assert groups(spec, "1f1b", 4)[0] == []
    # tied 1F1B: the table, between the first and the last rank
    got, _ = groups(tied, "1f1b", 4)
    assert got == [((0, 3), pytest.approx(table))]
    # tied DualPipe: the table (one name, two copies on each rank) joins the (0, 3) pair's
    # reduction once
    got, layers = groups(tied, "dualpipe", 4)
    params = chunk_params(tied, 2, layers)
    assert got[0] == ((0, 3), pytest.approx(params[0] + params[3] - table))
    # V placement puts the first and last chunk on rank 0: summed in memory, no collective
    assert groups(tied, "dualpipev", 4)[0] == []


def test_dualpipe_step_pays_the_copies_all_reduce_after_the_last_backward():
    from hyperloom.planner.simulate import predict

    spec = ModelSpec.from_model_config(preset_config("tiny"))
    cl = Cluster.of("h100", 2)
    kw = dict(pp=2, mbs=2, microbatches=8)
    dual = predict(spec, cl, Strategy(schedule="dualpipe", **kw), 256)
    one = predict(spec, cl, Strategy(schedule="1f1b", **kw), 256)
    link = p2p_link(cl, 2, 1)
    expect = collective_time("all_reduce", 2, 4.0 * spec.params(), link)  # both chunks, FP32
    assert dual.breakdown["shared_grad_sync"] == pytest.approx(expect)
    assert one.breakdown["shared_grad_sync"] == 0.0


def test_cpu_calibration_measures_every_core_and_restores_the_callers_threads(monkeypatch):
    import os

    import torch

    from hyperloom.planner import calibrate as cal

    seen = []
    monkeypatch.setattr(cal, "_calibrate", lambda *a: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank of a two-process job on two cores
    try:
        cal.calibrate("cpu")
        assert seen == [os.cpu_count()]  # a CPU profile is the whole machine
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_autocast_casts_cost_the_forward_backward_and_weight_gradient_passes():
    from hyperloom.planner.costs import layer_phase, links_for
    from hyperloom.planner.strategy import job_runtime

    spec = ModelSpec.from_model_config(preset_config("tiny"))
    s = Strategy(mbs=8)
    slow = dataclasses.replace(PROFILES["h100"], cast_eff=0.25)
    links = links_for(Cluster(slow, 1, 8), s)
    layer = build_layer(spec, 8, 256, 1, 1, False, False, 1, True)
    x = 8 * 256 * spec.dim
    assert layer.cast_elements == 5 * x and layer.cast_sum_elements == 3 * x  # q,k,v + w1,w3
    weights = sum(g.n * g.k * g.count for g in layer.gemms)
    per_op = layer_phase(layer, spec, s, slow, links, job_runtime())
    fast = layer_phase(
        layer, spec, s, dataclasses.replace(slow, cast_eff=1.0), links, job_runtime()
    )
    # a quarter of the copy rate: every cast costs four times as long, nothing else moves
    assert per_op.f - fast.f == pytest.approx(3 * slow.memory_time(6.0 * (5 * x + weights)))
    assert per_op.b - fast.b == pytest.approx(3 * slow.memory_time(6.0 * 5 * x + 12.0 * 3 * x))
    assert per_op.w - fast.w == pytest.approx(3 * slow.memory_time(6.0 * weights))
    # Megatron's BF16 parameters need no weight casts
    mega = RUNTIMES["megatron"]
    plain = build_layer(spec, 8, 256, 1, 1, False, mega.sharded_save, 1, False)
    assert plain.cast_elements == 0
    m_slow = layer_phase(plain, spec, s, slow, links, mega)
    assert m_slow == layer_phase(
        plain, spec, s, dataclasses.replace(slow, cast_eff=1.0), links, mega
    )


def test_zero1_step_counts_the_runtimes_unfused_adamw_and_publication():
    from hyperloom.planner.costs import optimizer_time

    acc, hl = PROFILES["h100"], RUNTIMES["hyperloom"]
    lean = dataclasses.replace(hl, zero1_step_extra=0.0, zero1_publish_bytes=0.0)
    z1, z0 = Strategy(dp=2, zero=1), Strategy(dp=2, zero=0)
    extra = optimizer_time(P, z1, acc, hl) - optimizer_time(P, z1, acc, lean)
    # per shard element 80 - 28 B of separate AdamW ops, 8 clip scaling, 8 slice copy-in;
    # per parameter 4 zeroing and 8 copy-out
    assert extra == pytest.approx(acc.memory_time(P / 2 * 68.0 + P * 12.0))
    assert optimizer_time(P, z0, acc, hl) == optimizer_time(P, z0, acc, lean)  # DDP: fused
    assert RUNTIMES["megatron"].zero1_step_extra == 0 == RUNTIMES["megatron"].zero1_publish_bytes


def test_megatron_step_scales_the_buckets_and_clips_the_shard():
    """Megatron's passes over its FP32 gradients (`Runtime.grad_prescale`,
    `Runtime.clip_shard_bytes`): with the distributed optimizer over dp 4, zeroing, the NaN
    check's read and the 1/dp scaling (r + w) of the whole buffer, 16 B a parameter, and on
    the shard AdamW 28, the norm 4, the clip 8 (r + w) and the BF16 copy 6, 46 B. At dp 1
    nothing is scaled. Before: 8 B and 38 B."""
    from hyperloom.planner.costs import optimizer_time

    acc, mega = PROFILES["b200"], RUNTIMES["megatron"]
    z1 = Strategy(dp=4, zero=1)
    assert optimizer_time(P, z1, acc, mega) == pytest.approx(acc.memory_time(P * 16 + P / 4 * 46))
    one = Strategy(dp=1, zero=1)
    assert optimizer_time(P, one, acc, mega) == pytest.approx(acc.memory_time(P * 8 + P * 46))
    # the hyperloom runtime is unchanged
    hl = RUNTIMES["hyperloom"]
    assert not hl.grad_prescale and hl.clip_shard_bytes == 0
