"""The B200 profile's kernels from public per-shape measurements (`planner.measured_b200`:
SimuMax's B200 system file), and the costs.py / fsdp.py split."""

from __future__ import annotations

import dataclasses

import pytest

from hyperloom.planner import measured_b200 as mb
from hyperloom.planner.hardware import HardwareProfile, match_shape
from hyperloom.planner.kernels import (
    AttentionModel,
    GemmModel,
    fit_attention_model,
    fit_gemm_model,
    gemm_forms,
)
from hyperloom.planner.profiles import B200, H100

PEAK = 2250e12


def test_the_b200_models_are_the_fit_of_the_public_measurements():
    """The profile's GEMM and attention constants are what the fits give on the stored
    measurements (so they can be reproduced, and change if the table does)."""
    gemm = fit_gemm_model(GemmModel(148, 1.0), mb.gemm_samples())
    assert B200.gemm_model.peak_eff == pytest.approx(gemm.peak_eff, rel=1e-4)
    assert B200.gemm_model.k_half == pytest.approx(gemm.k_half, rel=1e-4)
    attn = fit_attention_model(list(mb.attention_samples()))
    m = B200.attn_model
    assert (m.fwd_max, m.bwd_max) == pytest.approx((attn.fwd_max, attn.bwd_max), rel=1e-4)
    assert (m.seq_half, m.fwd_rows_half, m.bwd_rows_half) == pytest.approx(
        (attn.seq_half, attn.fwd_rows_half, attn.bwd_rows_half), rel=1e-4
    )
    assert B200.step_eff == 1.0 and B200.intra_eff == mb.INTRA_EFF  # 0.7424 of 900 GiB/s
    # 144 linears x 3 forms, all below the MAMF figure the profile used before (0.776)
    assert len(mb.gemm_samples()) == 432
    assert max(e for _, e in mb.gemm_samples()) < 0.7 < B200.gemm_eff


def test_a_measured_linear_runs_at_its_three_measured_efficiencies():
    # Llama 3 70B's qkv at 4,096 tokens: (4096 x 8192) @ (8192 x 10240)
    m, n, k = 4096.0, 10240.0, 8192.0
    f, d, w = next(e for t, kk, nn, *e in mb.LINEARS if (t, kk, nn) == (m, k, n))
    times = B200.gemm_times(m, n, k)
    for shape, eff, t in zip(gemm_forms(m, n, k), (f, d, w), times, strict=True):
        assert t == pytest.approx(2 * shape[0] * shape[1] * shape[2] / (PEAK * eff), rel=1e-9)
    # an unmeasured shape takes the fitted model (tile / wave quantization)
    odd = (3000.0, 7000.0, 5000.0)
    assert match_shape(B200.linear_table, odd) is None
    t = B200.gemm_times(*odd)[0]
    assert t == pytest.approx(2 * 3000 * 7000 * 5000 / (PEAK * B200.gemm_efficiency(*odd)))


def test_grouped_gemms_match_by_their_group_count():
    """DeepSeek-V2's routed experts at ep 8: 20 local experts of 1,232 rows each (TE's grouped
    GEMM measured at 0.33-0.51 of the BF16 peak); the same shape as one dense GEMM (no
    groups) takes the dense model, and another group count does not match."""
    g, rows, k, n, f, d, w = next(r for r in mb.GROUPED if r[:2] == (20, 1232) and r[3] == 3072)
    fwd, dgrad, wgrad = B200.gemm_times(1228.8, n, k, count=15, groups=20)  # 3 of 4 layers MoE
    assert fwd == pytest.approx(2 * 1228.8 * n * k * 15 / (PEAK * f), rel=1e-9)
    assert wgrad == pytest.approx(2 * 1228.8 * n * k * 15 / (PEAK * w), rel=1e-9)
    assert wgrad > dgrad > fwd  # measured: 0.33 < 0.42 < 0.51
    dense = 2 * 1228.8 * n * k * 15 / (PEAK * B200.gemm_model.efficiency(1228.8, n, k))
    assert B200.gemm_times(1228.8, n, k, count=15)[0] == pytest.approx(dense, rel=1e-9)
    assert B200.gemm_times(1228.8, n, k, count=15, groups=64)[0] != fwd


def test_attention_slows_with_few_heads_per_rank():
    """TE's B200 flash attention at 4K tokens: 8 heads (tp 8 of Llama 3 70B's 64) run the
    forward at about a third of 64 heads' rate, measured; the fitted model (query rows
    ``seq x heads``) carries that to shapes not measured, and H100's model has no such term."""
    flops = 1e12
    t64 = B200.attention_time(flops, seq=4096, head_dim=128, heads=64)
    t8 = B200.attention_time(flops, seq=4096, head_dim=128, heads=8)
    assert t8 / t64 == pytest.approx(0.872 / 0.310, rel=1e-3)  # SimuMax's two figures
    model = dataclasses.replace(B200, attn_shape_table=())
    assert model.attention_time(flops, seq=4096, head_dim=128, heads=8) > 2 * (
        model.attention_time(flops, seq=4096, head_dim=128, heads=64)
    )
    assert H100.attention_time(flops, seq=4096, heads=8) == H100.attention_time(flops, seq=4096)
    a = AttentionModel(0.5, 0.4, 0.0, fwd_rows_half=1000.0)
    assert a.efficiency(4096, rows=1000.0) == pytest.approx(0.25)
    assert a.efficiency(4096, backward=True, rows=1000.0) == pytest.approx(0.4)  # no bwd term


def test_profile_tables_survive_json():
    again = HardwareProfile.from_dict(B200.to_dict())
    assert again.linear_table == B200.linear_table and len(again.linear_table) == 144
    assert again.grouped_table == B200.grouped_table and again.attn_model == B200.attn_model
    assert again.attn_shape_table == B200.attn_shape_table
    assert again.gemm_times(4096.0, 10240.0, 8192.0) == B200.gemm_times(4096.0, 10240.0, 8192.0)


def test_simumax_step_times_meet_the_issue_targets_and_stay_fast():
    """Validation 6c (held out, kernel-calibrated): 24.4% mean before the measured kernels,
    10.0% / -21.2% before the FP32 weight gradients, Megatron's step passes and the measured
    permutation; now within the issue's targets (mean 8%, every row 20%), every row still
    fast (the MoE path's small kernels are not modelled)."""
    from hyperloom.planner.published_memory import simumax_step_time

    errs = [r.predicted / r.published - 1 for r in simumax_step_time()]
    assert len(errs) == 43 and all(e < 0 for e in errs)
    assert sum(abs(e) for e in errs) / len(errs) <= 0.08
    assert min(errs) >= -0.20


def test_fsdp_parts_live_in_their_own_module():
    """costs.py folds in fsdp.py's per-layer terms (and re-exports the gather groups)."""
    from hyperloom.planner import costs, fsdp

    assert costs.zero3_gather_groups is fsdp.zero3_gather_groups
    assert costs.zero3_layer_traffic is fsdp.zero3_layer_traffic


def test_weight_gradients_take_the_fp32_accumulating_measurement():
    """Megatron fuses the weight gradient into its FP32 main gradient, so each linear's NT form
    is the file's ``accumulate=True, out_dtype=fp32`` entry. Llama 3 405B's qkv at tp 8
    (4096 x 16384 -> 2560) runs there at 0.452; the BF16-output entry (0.647), which 82 of the
    144 rows carried before, made its weight gradient 30% fast."""
    w = next(e[2] for t, k, n, *e in mb.LINEARS if (t, k, n) == (4096, 16384, 2560))
    assert w == 0.452
    fc1 = next(e[2] for t, k, n, *e in mb.LINEARS if (t, k, n) == (4096, 16384, 13312))
    assert fc1 == 0.444
