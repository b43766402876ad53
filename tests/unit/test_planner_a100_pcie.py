"""A100 PCIe: groups that interleave share PCIe's bottleneck, and the held-out A100-PCIe set
(validation 6d: SimuMax's measured Megatron-LM runs on 8 A100 PCIe)."""

from __future__ import annotations

import pytest

from hyperloom.planner import measured_a100_pcie as ma
from hyperloom.planner import measured_b200 as mb
from hyperloom.planner.collectives import collective_time, group_link
from hyperloom.planner.hardware import Cluster
from hyperloom.planner.kernels import GemmModel, fit_attention_model, fit_gemm_model
from hyperloom.planner.network import get_tier
from hyperloom.planner.profiles import PROFILES
from hyperloom.planner.published_a100_pcie import (
    SIMUMAX_A100_PCIE,
    a100_pcie_step_time,
    measured_ms,
)

GIB = 1024**3


def _ar(n: int) -> float:
    """SimuMax's measured all-reduce bus bandwidth of an n-rank group on the node, B/s."""
    return ma.NCCL_FIT[n]["all_reduce"][0] * 30 * GIB


def test_pcie_groups_take_the_measured_bandwidth_of_their_size():
    """The pcie-a100 tier: 2 and 4 GPUs (one PCIe switch) all-reduce at 22 GB/s, 8 (across
    the sockets) at 13.5; each kind at its own measured bus bandwidth and step latency."""
    cl = Cluster.of("a100-pcie", 8)
    for n in (2, 4, 8):
        assert group_link(cl, n, 1).bandwidth == pytest.approx(_ar(n))
    t = collective_time("all_to_all", 8, 1e9, group_link(cl, 8, 1))
    eff, us = ma.NCCL_FIT[8]["all_to_all"]
    assert t == pytest.approx(1e9 * 7 / 8 / (eff * 30 * GIB) + 7 * us * 1e-6)


def test_interleaved_pcie_groups_share_the_span_they_cover():
    """tp 2 x dp 4 on one PCIe node: the two dp groups {0,2,4,6} and {1,3,5,7} run at once
    over all eight GPUs, so each gets the 8-rank bandwidth halved; tp 4 x dp 2, four pairs,
    a quarter. Before: a strided pair ran as fast as two neighbours."""
    cl = Cluster.of("a100-pcie", 8)
    assert get_tier(cl.profile.intra_tier).shared
    assert group_link(cl, 4, 2).bandwidth == pytest.approx(_ar(8) / 2)
    assert group_link(cl, 2, 4).bandwidth == pytest.approx(_ar(8) / 4)
    # NVSwitch has no shared bottleneck: the stride does not matter there
    sxm = Cluster.of("a100", 8)
    assert group_link(sxm, 2, 4).bandwidth == group_link(sxm, 2, 1).bandwidth


@pytest.mark.parametrize(("size", "stride", "gib_s"), [(4, 2, 7.65), (2, 4, 4.0)])
def test_strided_all_gather_is_near_simumax_measurement(size, stride, gib_s):
    """SimuMax's A100-PCIe system file measures a dense dp group's all-gather at 7.65 GiB/s
    (4 ranks over the node) and 4.0 (2 ranks); the shared-span term, not fitted to them,
    gives 6.7 and 3.4 GiB/s (13% and 19% slow) where a lone group of that size would be 2.7x
    and 5.1x fast."""
    cl = Cluster.of("a100-pcie", 8)
    nbytes = 1e9
    t = collective_time("all_gather", size, nbytes, group_link(cl, size, stride))
    measured = nbytes * (size - 1) / size / (gib_s * GIB)
    assert measured < t < 1.25 * measured


def test_a100_pcie_kernels_are_the_public_measurements_and_their_fit():
    """The profile's tables restate SimuMax's A100-PCIe kernel file; its GEMM and attention
    models are the fits on them; MoE token permutation runs at the measured 0.19 of
    1,600 GiB/s (323 GB/s), not at the elementwise rate."""
    acc = PROFILES["a100-pcie"]
    gemm = fit_gemm_model(GemmModel(108, 1.0), mb.gemm_samples(ma.LINEARS))
    assert acc.gemm_model.peak_eff == pytest.approx(gemm.peak_eff, rel=1e-4)
    assert acc.gemm_model.k_half == pytest.approx(gemm.k_half, rel=1e-4)
    attn = fit_attention_model(list(mb.attention_samples(ma.ATTENTION)))
    m = acc.attn_model
    assert (m.fwd_max, m.bwd_max) == pytest.approx((attn.fwd_max, attn.bwd_max), rel=1e-4)
    assert (m.fwd_rows_half, m.bwd_rows_half) == pytest.approx(
        (attn.fwd_rows_half, attn.bwd_rows_half), rel=1e-4
    )
    assert len(acc.linear_table) == 61 and len(acc.grouped_table) == 4
    # DeepSeek-V2's wo at 4,096 tokens: (4096 x 16384) @ (16384 x 5120), measured 3 ways
    f, d, w = next(e for t, k, n, *e in ma.LINEARS if (t, k, n) == (4096, 16384, 5120))
    times = acc.gemm_times(4096.0, 5120.0, 16384.0)
    flops = 2 * 4096 * 16384 * 5120
    assert times == pytest.approx(tuple(flops / (312e12 * e) for e in (f, d, w)))
    assert acc.permute_time(1e9) == pytest.approx(1e9 / (0.1879 * 1600 * GIB))
    assert acc.permute_time(1e9) > 4 * acc.elementwise_time(1e9)


def test_measured_step_is_the_prediction_scaled_by_the_throughput_error():
    # 70B tp1 pp2, 32 micro-batches: SimuMax predicts 25,532.7 ms at +2.12% TFLOP/s
    assert measured_ms(25532.7, 2.12) == pytest.approx(25532.7 * 1.0212)
    assert len(SIMUMAX_A100_PCIE) == 10 and sum(len(r[5]) for r in SIMUMAX_A100_PCIE) == 30


def test_held_out_a100_pcie_runs_meet_the_issue_targets():
    """Validation 6d: mean |error| within 8%, every run within 20% (the a priori profile
    before the shared-span term: 10.4% mean, -32.8% at 70B tp 4 with 4 micro-batches)."""
    errs = [r.predicted / r.published - 1 for r in a100_pcie_step_time()]
    assert len(errs) == 30
    assert sum(abs(e) for e in errs) / len(errs) <= 0.08
    assert max(abs(e) for e in errs) <= 0.20
