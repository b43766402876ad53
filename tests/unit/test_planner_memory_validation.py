"""Issue 34: peak memory held against measured GPU runs, and the fixes that made it hold.

The measured set is SimuMax's B200 release (Megatron-LM on 8 B200s; `published_memory`). Each
other test pins one cause the set exposed (or one gap the issue named) and fails on the
planner before it: TE's in-place fused cross-entropy, TE's cached dummy weight gradients,
DeepSeek's dense layers on the first stage, FSDP2's buffers at the gather width and its root
gather, HSDP, and the ring's overlap default.
"""

from __future__ import annotations

import dataclasses

import pytest

from hyperloom.config import JobConfig
from hyperloom.planner import Cluster, predict
from hyperloom.planner.costs import (
    context_comm,
    dp_sync,
    layer_phase,
    links_for,
    optimizer_time,
)
from hyperloom.planner.fsdp import root_gather_time
from hyperloom.planner.hardware import GIB
from hyperloom.planner.memory import states
from hyperloom.planner.model import build_layer
from hyperloom.planner.published import llama
from hyperloom.planner.published_memory import (
    SIMUMAX_B200,
    SIMUMAX_RUNTIME,
    simumax_memory,
    simumax_model,
    simumax_plan,
)
from hyperloom.planner.simulate import prepare
from hyperloom.planner.strategy import RUNTIMES, Strategy

MEGATRON = RUNTIMES["megatron"]


def test_simumax_b200_peaks_meet_the_issue_targets():
    """Allocated peaks within 5% (dense, MoE) and 10% (cp) of the measured ones; reserved
    (peak / 0.94) within 5%. Measured after the fixes: every allocated row within 2.0%."""
    rows = simumax_memory()
    assert len(rows) == 2 * len(SIMUMAX_B200) == 38
    for r in rows:
        bound = 0.10 if " cp" in r.case else 0.05
        assert abs(r.error) <= bound, (r.case, r.quantity, r.error)
    allocated = [abs(r.error) for r in rows if r.quantity.startswith("allocated")]
    assert max(allocated) < 0.025
    assert sum(allocated) / len(allocated) < 0.015


def test_te_fused_cross_entropy_keeps_bf16_logits_and_no_fp32_copies():
    """`--cross-entropy-loss-fusion` (TE): the head saves its BF16 logits, which hold the
    gradient, and makes no 10 B-per-logit FP32 working set."""
    row = SIMUMAX_B200[3]  # llama3-70b l12 tp8: one stage, the head on it
    fused, plain = simumax_plan(row), simumax_plan(row, rt=dataclasses.replace(SIMUMAX_RUNTIME,
                                                                              ce_in_place=False))  # fmt: skip
    logits = 4096 * 128256 / 8
    a, b = fused.memory[0], plain.memory[0]
    assert b.activations - a.activations == pytest.approx(2.0 * logits)  # 4 B -> 2 B saved
    assert b.transient == pytest.approx(10.0 * logits)
    assert a.transient < 0.2 * b.transient


def test_megatron_with_te_keeps_one_dummy_wgrad_per_weight_shape():
    """Megatron's gradient-accumulation fusion hands autograd a cached BF16 tensor per weight
    shape (TE `get_dummy_wgrad`): 2 B per element of one layer's matrices / tp."""
    spec = llama("llama3-405b", 4, 16384, 128, 16, 53248, 128256)
    s = Strategy(tp=2, dp=4, zero=1, microbatches=4)
    cl = Cluster.of("b200", 8)
    with_, without = (
        predict(spec, cl, s, 4096, rt).memory[0]
        for rt in (MEGATRON, dataclasses.replace(MEGATRON, te_dummy_wgrad=False))
    )
    assert with_.buffers - without.buffers == pytest.approx(2.0 * spec.layer_matmul_params() / 2)


def test_dense_layers_sit_on_the_first_stage():
    """DeepSeek-V3 cut to 4 layers (1 dense) over pp 2: stage 0 holds 1 MoE layer's experts,
    stage 1 two (the mean layer gave each 1.5); the model's total is unchanged."""
    spec = simumax_model("deepseek-v3", 4)
    assert spec.chunk_layer_params(0, 2)[1] == spec.routed_expert_params()
    assert spec.chunk_layer_params(2, 2)[1] == 2 * spec.routed_expert_params()
    total = spec.chunk_layer_params(0, 2)[0] + spec.chunk_layer_params(2, 2)[0]
    assert total == pytest.approx(4 * spec.layer_params())
    plan = simumax_plan(SIMUMAX_B200[11])  # deepseek-v3 ep4 pp2, measured 114.0 GiB
    first, last = (m.peak / GIB for m in plan.memory)
    assert last > first + 30  # the stage with two MoE layers holds twice the expert states
    assert last == pytest.approx(114.0, rel=0.02)


def _fsdp(width: int, **kw):
    spec = llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256)
    rt = dataclasses.replace(
        RUNTIMES["hyperloom"], param_gather_bytes=width, autocast_weight_copy=False
    )
    s = Strategy(dp=8, zero=3, microbatches=1, **kw)
    return spec, s, rt, predict(spec, Cluster.of("h100", 8), s, 8192, rt)


def test_fsdp_buffers_take_the_gather_width_and_the_root():
    """Two gathered blocks at `param_gather_bytes` (they were 2 B whatever the width), one
    block's gradient, and the root's embedding and head held through the step."""
    spec, _, _, bf16 = _fsdp(2)
    _, _, _, fp32 = _fsdp(4)
    layer = spec.layer_params()
    assert fp32.memory[0].buffers - bf16.memory[0].buffers == pytest.approx(
        2 * 2.0 * layer + 2.0 * (2 * spec.embedding_params() + spec.dim)
    )
    root = 2 * spec.embedding_params() + spec.dim
    assert bf16.memory[0].buffers == pytest.approx(4.0 * layer + 4.0 * layer + 2.0 * root)


def test_fsdp_root_gather_is_costed_once_per_forward():
    spec, s, rt, plan = _fsdp(2)
    links = links_for(Cluster.of("h100", 8), s)
    emb, head = (root_gather_time(spec, s, rt, links, last) for last in (False, True))
    assert emb > 0 and head > 0
    assert root_gather_time(spec, dataclasses.replace(s, zero=1), rt, links, False) == 0
    assert plan.breakdown["zero3_gather"] >= emb + head


def test_hsdp_is_planned_not_refused():
    """`parallel.dp_replicate`: states sharded over one replica group, gradients
    reduce-scattered there and the shard all-reduced across the groups."""
    job = JobConfig()
    job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, dp=8, zero=3,
                                                                dp_replicate=2))  # fmt: skip
    s = Strategy.from_job(job)
    assert (s.dp_replicate, s.fsdp_shard) == (2, 4)
    spec, _, rt, _ = _fsdp(2)
    hsdp, flat = dataclasses.replace(s, microbatches=1), Strategy(dp=8, zero=3)
    p = 1e9
    assert states(p, hsdp, rt)[2] == pytest.approx(2 * states(p, flat, rt)[2])
    cl = Cluster.of("h100", 16)
    links = links_for(cl, hsdp)
    assert links.shard is not None and links.replicate is not None
    total, _ = dp_sync(p, 1.0, 1.0, hsdp, links, rt)
    flat_total, _ = dp_sync(p, 1.0, 1.0, flat, links_for(cl, flat), rt)
    assert total > 0 and total != flat_total
    acc = cl.profile
    assert optimizer_time(p, hsdp, acc, rt) > optimizer_time(p, flat, acc, rt)
    plan = predict(spec, Cluster.of("h100", 8), hsdp, 8192, rt)
    assert plan.step_time > 0 and "hsdp2" in plan.strategy.label()


def test_ring_exchange_shorter_than_its_step_is_not_free_by_default():
    """Issue 34 finding 3: with `cp_overlap` 1 a ring exchange shorter than its attention
    step cost nothing; the default now charges the SMs its kernels take (0.15 of it)."""
    rt = RUNTIMES["hyperloom"]
    assert rt.cp_overlap < 1.0
    spec = llama("llama3-8b", 2, 4096, 32, 8, 14336, 128256)
    s = Strategy(dp=2, cp=4)
    prep = prepare(spec, Cluster.of("h100", 8), s, 32768, rt)
    layer = build_layer(spec, 1, 32768, 1, 4, True)
    fwd, _ = context_comm(layer, s, prep.links, rt, 1.0, 2.5)  # steps far longer than sends
    assert fwd > 0.0


def test_fsdp2_copies_run_on_the_compute_stream():
    """Each gather's copy-out (read + write at the gather width) in F and B, and the
    reduce-scatter copy-in (gather width in, FP32 out) once per step (torchtitan's 6b)."""
    spec, s, rt, _ = _fsdp(2)
    cl = Cluster.of("h100", 8)
    acc, links = cl.profile, links_for(cl, s)
    layer = build_layer(spec, 1, 8192, 1, 1, False)
    on = layer_phase(layer, spec, s, acc, links, rt)
    off = layer_phase(layer, spec, s, acc, links, dataclasses.replace(rt, fsdp2_copies=False))
    gathered = spec.layer_params()
    out = acc.memory_time(2.0 * 2 * gathered)
    assert on.f - off.f == pytest.approx(out)
    assert on.b - off.b == pytest.approx(out + acc.memory_time((2 + 4) * gathered))
    assert layer_phase(layer, spec, s, acc, links, MEGATRON).f < on.f  # Megatron: no copies


def test_zero3_optimizer_touches_gradient_shards_only():
    """ZeRO-3 clips and zeroes the gradient shard it holds, not whole gradients."""
    p, rt, acc = 8e9, RUNTIMES["hyperloom"], Cluster.of("a100", 64).profile
    z3 = optimizer_time(p, Strategy(dp=64, zero=3), acc, rt)
    assert z3 == pytest.approx(acc.memory_time(p / 64 * (28.0 + 8.0)))
