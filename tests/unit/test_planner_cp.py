"""Context parallelism in the planner: ring attention's per-step exchanges against its
per-step compute, Ulysses' four all-to-alls each way, their buffers, the gradient group,
and `parallel.cp_comm` from the job through the CLI and the search."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from rich.console import Console

from hyperloom.config import ModelConfig, preset_config
from hyperloom.planner import Cluster, ModelSpec, PlanError, SearchSpace, search
from hyperloom.planner.cli import add_plan_parser, load_job, parse_fix
from hyperloom.planner.collectives import all_to_all_time, collective_time
from hyperloom.planner.costs import context_comm, layer_phase, links_for
from hyperloom.planner.hardware import get_profile
from hyperloom.planner.memory import LayerMemory, cp_buffer, rank_memory
from hyperloom.planner.model import build_layer
from hyperloom.planner.network import TIERS
from hyperloom.planner.report import plans_table
from hyperloom.planner.search import candidates
from hyperloom.planner.selfcheck import cpu_runtime
from hyperloom.planner.simulate import predict
from hyperloom.planner.strategy import RUNTIMES, Strategy, check

H100 = get_profile("h100")
RT = RUNTIMES["hyperloom"]


def _spec(heads: int, kv_heads: int | None = None, head_dim: int = 128) -> ModelSpec:
    cfg = ModelConfig(
        preset="cp-toy",
        n_layers=8,
        dim=heads * head_dim,
        n_heads=heads,
        n_kv_heads=kv_heads or heads,
        ffn_dim=4096,
        vocab_size=32000,
    )
    return ModelSpec(cfg, "cp-toy")


MHA16 = _spec(16)  # 16 heads: divide by cp 2, 4, 8 at tp 1
MHA12 = _spec(12)  # 12 heads: not by cp 8


def _phase(spec, s, seq, cluster, rt=RT):
    layer = build_layer(spec, s.mbs, seq, s.tp, s.cp, s.sp, rt.sharded_save, s.ep)
    links = links_for(cluster, s, spec)
    return layer, links, layer_phase(layer, spec, s, cluster.profile, links, rt)


def test_alltoall_is_four_all_to_alls_each_way_of_the_local_q_k_v_and_output():
    cluster = Cluster(H100, 8, 8)
    s = Strategy(dp=2, cp=4, cp_comm="alltoall")
    seq = 8192
    layer, links, phase = _phase(MHA16, s, seq, cluster)
    local = 2.0 * (seq / 4) * MHA16.dim  # BF16 q (= k = v = output for MHA) of s/cp tokens
    one = collective_time("all_to_all", 4, local, links.cp)
    assert one > 0 and links.cp.level == "intra"
    assert context_comm(layer, s, links, RT, 1.0, 1.0) == pytest.approx((4 * one, 4 * one))
    assert phase.cp_comm == pytest.approx(8 * one)  # nothing hidden, whatever the compute
    # across nodes the off-node half leaves through the rank's NIC (the plain all-to-all)
    wide = Strategy(tp=8, cp=2, cp_comm="alltoall")
    layer, links, phase = _phase(MHA16, wide, seq, Cluster(H100, 16, 8))
    q = 2.0 * (seq / 2) * MHA16.dim / 8
    assert links.cp_a2a.level == "inter"
    assert phase.cp_comm == pytest.approx(8 * all_to_all_time(Cluster(H100, 16, 8), 2, q, 8))


def test_alltoall_repeats_kv_heads_that_do_not_divide_by_cp():
    gqa = _spec(16, kv_heads=2)
    q = 2048 * gqa.q_dim
    repeated = build_layer(gqa, 1, 8192, 1, 4, False).cp_a2a  # 2 kv heads over cp 4
    assert repeated == (q, q, q, q)
    kept = build_layer(gqa, 1, 8192, 1, 2, False).cp_a2a
    assert kept == (2 * q, q / 4, q / 4, 2 * q)  # twice the tokens, 2 kv heads of 16


def test_ring_hides_each_exchange_behind_its_step_until_the_link_is_slow():
    s, seq, cp = Strategy(dp=2, cp=4), 32768, 4
    fast = Cluster(H100, 8, 8)
    layer, links, phase = _phase(MHA16, s, seq, fast)
    tokens = seq / cp
    elements = tokens * 2 * MHA16.dim  # K and V of the local tokens
    assert layer.cp_kv == elements
    # h100 NVLink x the all-reduce's efficiency x the tier's p2p factor, latency
    bw = H100.intra_gbs * 1e9 * H100.intra_eff * TIERS["nvlink"].efficiency("p2p")
    lat = 1.5e-6
    kv, dkv = lat + 2 * elements / bw, lat + 4 * elements / bw  # BF16 K/V, FP32 dK/dV
    attn_f = H100.attention_time(layer.attn_flops, seq=seq)
    attn_b = H100.attention_time(2.5 * layer.attn_flops, backward=True, seq=seq)
    assert attn_f / cp > kv and attn_b / cp > kv + dkv  # every step outlasts its exchange
    fwd, bwd = context_comm(layer, s, links, RT, attn_f, attn_b)
    lost = 1.0 - RT.cp_overlap  # what an exchange shorter than its step still costs
    assert fwd == pytest.approx((cp - 1) * lost * kv)
    # the last dK/dV exchange is exposed whole
    assert bwd == pytest.approx(lost * (kv + (cp - 2) * (kv + dkv) + dkv) + dkv)
    assert phase.cp_comm == pytest.approx(fwd + bwd)

    slow = Cluster(dataclasses.replace(H100, intra_gbs=1.0), 8, 8)
    layer, links, phase = _phase(MHA16, s, seq, slow)
    bw = 1e9 * H100.intra_eff * TIERS["nvlink"].efficiency("p2p")
    kv, dkv = lat + 2 * elements / bw, lat + 4 * elements / bw
    f, b = attn_f / cp, attn_b / cp
    assert kv > b  # the link is slower than any step
    fwd, bwd = context_comm(layer, s, links, RT, attn_f, attn_b)
    eta = RT.cp_overlap
    assert fwd == pytest.approx((cp - 1) * (kv - eta * f))
    assert bwd == pytest.approx(
        (kv - eta * b) + (cp - 2) * (kv + dkv - eta * b) + (dkv - eta * b) + dkv
    )
    assert phase.cp_comm == pytest.approx(fwd + bwd)

    # on CPU ranks gloo's exchanges take their time from the compute: nothing hides
    cpu = cpu_runtime(RT)
    fwd, bwd = context_comm(layer, s, links, cpu, attn_f, attn_b)
    assert (fwd, bwd) == pytest.approx(((cp - 1) * kv, (cp - 1) * kv + cp * dkv))


def test_ring_exchanges_go_to_the_neighbour_over_one_nic_across_nodes():
    """A ring spanning nodes is as fast as its slowest pair: one NIC, not the group's."""
    s = Strategy(tp=1, cp=16)
    links = links_for(Cluster(H100, 16, 8), s)
    assert links.cp_p2p.level == "inter"
    assert links.cp_p2p.bandwidth == pytest.approx(H100.nic_gbs * 1e9 * H100.inter_eff)
    assert links.cp.bandwidth > links.cp_p2p.bandwidth  # the ring collective's 8 NICs


def test_core_recompute_reruns_the_ring_not_the_all_to_all():
    slow = Cluster(dataclasses.replace(H100, intra_gbs=1.0), 8, 8)
    for form, reruns in (("ring", True), ("alltoall", False)):
        base = Strategy(dp=2, cp=4, cp_comm=form)
        _, _, none = _phase(MHA16, base, 8192, slow)
        _, links, core = _phase(MHA16, dataclasses.replace(base, recompute="core_attn"), 8192, slow)
        layer = build_layer(MHA16, 1, 8192, 1, 4, False, RT.sharded_save)
        attn_f = H100.attention_time(layer.attn_flops, seq=8192)
        fwd, _ = context_comm(layer, base, links, RT, attn_f, 1.0)
        assert core.recompute == pytest.approx(attn_f + (fwd if reruns else 0.0))
        assert core.b - none.b == pytest.approx(core.recompute)


def test_cp1_ignores_the_form():
    cluster = Cluster(H100, 8, 8)
    s = Strategy(dp=8, zero=1, microbatches=2)
    ring = predict(MHA16, cluster, s, 4096)
    a2a = predict(MHA16, cluster, dataclasses.replace(s, cp_comm="alltoall"), 4096)
    assert a2a.step_time == ring.step_time and a2a.breakdown["cp_comm"] == 0.0
    assert [m.peak for m in a2a.memory] == [m.peak for m in ring.memory]
    layer = build_layer(MHA16, 1, 4096, 1, 1, False)
    assert (
        cp_buffer(layer, s) == 0.0 == cp_buffer(layer, dataclasses.replace(s, cp_comm="alltoall"))
    )


def test_each_form_holds_its_buffers_in_the_backward_working_set():
    seq, cp = 8192, 4
    tokens = seq / cp
    layer = build_layer(MHA16, 1, seq, 1, cp, False)
    d, heads = MHA16.dim, MHA16.n_heads
    ring = Strategy(dp=2, cp=cp)
    # two BF16 K/V blocks, then the larger of the FP32 output + lse accumulators and the
    # FP32 dQ + two FP32 dK/dV blocks
    kv = tokens * 2 * d
    expected = 2 * 2 * kv + max(4 * tokens * (d + heads), 4 * (tokens * d + 2 * kv))
    assert cp_buffer(layer, ring) == pytest.approx(expected)
    a2a = dataclasses.replace(ring, cp_comm="alltoall")
    assert cp_buffer(layer, a2a) == pytest.approx(2 * 4 * tokens * d)  # q, k, v, output
    # a first chunk (no loss) carries them in its transient
    plain = LayerMemory.of(layer, "none", False)
    held = LayerMemory.of(layer, "none", False, cp=cp_buffer(layer, ring))
    args = (MHA16, ring, RT, seq)
    chunk = ((0,), [4, 4], [1e8, 1e8], 1, 0)
    diff = rank_memory(*args, held, *chunk).transient - rank_memory(*args, plain, *chunk).transient
    assert diff == pytest.approx(expected)


def test_context_ranks_sum_gradients_and_shard_zero_with_the_data_ranks():
    cluster = Cluster(H100, 4, 8)
    cp = predict(MHA16, cluster, Strategy(dp=2, cp=2, zero=1, microbatches=2), 4096)
    dp = predict(MHA16, cluster, Strategy(dp=4, zero=1, microbatches=2), 4096)
    assert Strategy(dp=2, cp=2).dcp == 4
    assert cp.breakdown["dp_sync_total"] == pytest.approx(dp.breakdown["dp_sync_total"])
    assert cp.memory[0].optimizer == pytest.approx(dp.memory[0].optimizer)


def test_cp_comm_comes_from_the_job():
    base = ["--parallel.dp", "2", "--parallel.cp", "4"]
    assert Strategy.from_job(load_job(None, base)).cp_comm == "ring"
    job = load_job(None, [*base, "--parallel.cp_comm", "alltoall"])
    s = Strategy.from_job(job)
    assert (s.cp, s.cp_comm) == (4, "alltoall") and "cp4a2a" in s.label()


def test_check_wants_the_heads_per_tp_rank_to_divide_by_cp_for_alltoall():
    s = Strategy(cp=8, cp_comm="alltoall")
    why = check(s, MHA12, 8192, 8)
    assert "n_heads / tp = 12 / 1 = 12" in why and "cp (8)" in why
    assert check(dataclasses.replace(s, cp_comm="ring"), MHA12, 8192, 8) is None
    assert check(s, MHA16, 8192, 8) is None
    assert "cp_comm must be one of" in check(dataclasses.replace(s, cp_comm="p2p"), MHA16, 8192)
    with pytest.raises(PlanError, match="cp_comm 'alltoall'"):
        predict(MHA12, Cluster(H100, 8, 8), s, 8192)


def test_search_tries_alltoall_only_where_heads_divide_and_reports_the_pick():
    space = SearchSpace().fixed(fp8=False)
    for spec in (MHA16, MHA12):
        points = [p for p in candidates(spec, 16, 32, space, True) if p.cp > 1]
        forms = {(p.tp, p.cp, p.cp_comm) for p in points}
        for tp, cp, form in forms:
            assert form == "ring" or (spec.n_heads // tp) % cp == 0
            assert (tp, cp, "ring") in forms
        a2a = {(tp, cp) for tp, cp, form in forms if form == "alltoall"}
        divides = {(tp, cp) for tp, cp, _ in forms if (spec.n_heads // tp) % cp == 0}
        assert a2a == divides and a2a
    assert (1, 8) in {(tp, cp) for tp, cp, _ in forms} and (1, 8) not in a2a  # MHA12

    # short local blocks: the ring's steps are too short to hide its exchanges
    pinned = SearchSpace().fixed(tp=1, cp=8, pp=1, zero=0, mbs=1, recompute="none", fp8=False)
    cluster = Cluster(H100, 8, 8)
    best = search(MHA16, cluster, 8, 8192, space=pinned, top_k=2).top
    assert [p.strategy.cp_comm for p in best] == ["alltoall", "ring"]
    assert best[0].breakdown["cp_comm"] < best[1].breakdown["cp_comm"]
    console = Console(width=200, record=True)
    console.print(plans_table(best, "cp"))
    assert "8 a2a" in console.export_text()
    only_ring = search(MHA12, cluster, 8, 8192, space=pinned, top_k=2).top
    assert [p.strategy.cp_comm for p in only_ring] == ["ring"]
    assert parse_fix("cp_comm=ring/alltoall") == {"cp_comm": ("ring", "alltoall")}


def test_cli_predict_takes_the_jobs_cp_comm_or_the_flag(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        '[model]\npreset = "tiny"\n[parallel]\ndp = 2\ncp = 2\ncp_comm = "alltoall"\n'
        "[train]\nmicro_batch_size = 1\n[data]\nseq_len = 1024\n"
    )

    def plan(*flags: str) -> dict:
        parser = argparse.ArgumentParser()
        add_plan_parser(parser.add_subparsers(dest="command"))
        out = tmp_path / "p.json"
        args = parser.parse_args(["plan", "predict", str(cfg), *flags, "--json", str(out)])
        args.overrides = []
        assert args.func(args) == 0
        (one,) = json.loads(out.read_text())["plans"]
        return one

    assert plan()["strategy"]["cp_comm"] == "alltoall"
    ring = plan("--cp-comm", "ring")
    assert ring["strategy"]["cp_comm"] == "ring" and "a2a" not in ring["label"]
    assert ring["breakdown_s"]["cp_comm"] > 0


def test_mla_ring_passes_the_compressed_latent_unless_wkv_b_is_fp8():
    """DeepSeek's ring sends [c_kv ‖ k_pe] per token (whole on every tp rank) and saves it
    in place of per-head K and V, expanding with wkv_b once per ring step; with wkv_b in FP8
    (or under all-to-all) K and V travel per head, as `models.deepseek.mla` does."""
    spec = ModelSpec.from_model_config(preset_config("deepseek-v3"), "deepseek-v3")
    latent = spec.kv_lora_rank + spec.qk_rope_head_dim  # 576
    per_head = spec.n_heads * (spec.qk_head_dim + spec.v_head_dim) / 8  # tp 8
    args = (spec, 1, 4096, 8, 4, False, True, 1)
    ring = build_layer(*args, latent_ring=True)
    plain = build_layer(*args)
    tokens = 4096 / 4
    assert ring.cp_kv == tokens * latent and plain.cp_kv == tokens * per_head
    assert ring.cp_kv < plain.cp_kv / 8  # 576 values against 128 / 8 heads x (192 + 128)
    names = {x.name for x in ring.saved}
    assert (
        "latent" in names and not {"k", "v"} & names and {"k", "v"} <= {x.name for x in plain.saved}
    )
    wkv_b = {g.name: g.count for g in ring.gemms}["wkv_b"]
    assert wkv_b == 4 and {g.name: g.count for g in plain.gemms}["wkv_b"] == 1
    # the simulator chooses it: ring without FP8 only
    cluster = Cluster.of("h100", 64)
    base = Strategy(tp=8, pp=1, dp=2, cp=4, zero=1, mbs=1, microbatches=1)
    sent = {
        fp8: predict(spec, cluster, dataclasses.replace(base, fp8=fp8), 4096, RT)
        for fp8 in (False, True)
    }
    assert sent[False].breakdown["cp_comm"] < sent[True].breakdown["cp_comm"]


def test_mtp_runs_on_whole_sequences_under_cp():
    """Every cp rank runs DeepSeek's MTP modules on the whole sequences (gathered), so what
    MTP adds to a cp 2 rank's step time and memory is what it adds to one process with the
    same sequences, not half of it."""
    with_mtp = ModelSpec.from_model_config(preset_config("moe-tiny"), "moe-tiny")
    assert with_mtp.mtp_depth > 0
    cfg = dataclasses.replace(preset_config("moe-tiny"), mtp_depth=0)
    without = ModelSpec.from_model_config(cfg, "moe-tiny")
    added = {}
    for cp in (1, 2):
        s = Strategy(tp=1, pp=1, dp=1, cp=cp, zero=0, mbs=2, microbatches=1)
        cluster = Cluster.of("h100", cp)
        a, b = (predict(spec, cluster, s, 4096, RT) for spec in (with_mtp, without))
        added[cp] = (a.step_time - b.step_time, a.memory[0].peak - b.memory[0].peak)
    for i in (0, 1):
        assert added[2][i] == pytest.approx(added[1][i], rel=0.1), added
