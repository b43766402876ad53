"""A100 PCIe: groups that interleave share PCIe's bottleneck, and the held-out A100-PCIe set
(validation 6d: SimuMax's measured Megatron-LM runs on 8 A100 PCIe)."""

from __future__ import annotations

import pytest

from hyperloom.planner.collectives import collective_time, group_link
from hyperloom.planner.hardware import Cluster
from hyperloom.planner.network import get_tier
from hyperloom.planner.published_a100_pcie import (
    SIMUMAX_A100_PCIE,
    a100_pcie_step_time,
    measured_ms,
)

GIB = 1024**3


def test_interleaved_pcie_groups_share_the_span_they_cover():
    """tp 2 x dp 4 on one PCIe node: the two dp groups {0,2,4,6} and {1,3,5,7} run at once
    over all eight GPUs' root complex, so each gets the 8-rank bandwidth halved; tp 4 x dp 2,
    four pairs, a quarter. Before: a strided pair ran as fast as two neighbours."""
    cl = Cluster.of("a100-pcie", 8)
    acc, tier = cl.profile, get_tier(cl.profile.intra_tier)
    base = acc.intra_gbs * 1e9 * acc.intra_eff
    assert tier.shared
    assert group_link(cl, 4, 1).bandwidth == pytest.approx(base * tier.group_factor(4))
    assert group_link(cl, 4, 2).bandwidth == pytest.approx(base * tier.group_factor(8) / 2)
    assert group_link(cl, 2, 4).bandwidth == pytest.approx(base * tier.group_factor(8) / 4)
    # NVSwitch has no shared bottleneck: the stride does not matter there
    sxm = Cluster.of("a100", 8)
    assert group_link(sxm, 2, 4).bandwidth == group_link(sxm, 2, 1).bandwidth


@pytest.mark.parametrize(("size", "stride", "gib_s"), [(4, 2, 7.65), (2, 4, 4.0)])
def test_strided_all_gather_is_near_simumax_measurement(size, stride, gib_s):
    """SimuMax's A100-PCIe system file measures a dense dp group's all-gather at 7.65 GiB/s
    (4 ranks over the node) and 4.0 (2 ranks); the tier model, not fitted to them, is 20%
    and 25% slower (6.9 and 3.4 GB/s of bus bandwidth) where it was 2x and 5x faster."""
    cl = Cluster.of("a100-pcie", 8)
    nbytes = 1e9
    t = collective_time("all_gather", size, nbytes, group_link(cl, size, stride))
    measured = nbytes * (size - 1) / size / (gib_s * GIB)
    assert measured < t < 1.3 * measured


def test_measured_step_is_the_prediction_scaled_by_the_throughput_error():
    # 70B tp1 pp2, 32 micro-batches: SimuMax predicts 25,532.7 ms at +2.12% TFLOP/s
    assert measured_ms(25532.7, 2.12) == pytest.approx(25532.7 * 1.0212)
    assert len(SIMUMAX_A100_PCIE) == 10 and sum(len(r[5]) for r in SIMUMAX_A100_PCIE) == 30


def test_held_out_a100_pcie_runs_meet_the_issue_targets():
    """Validation 6d: mean |error| within 8%, every run within 20% (before the shared-span
    term: 10.4% mean, -32.8% at 70B tp 4 with 4 micro-batches)."""
    errs = [r.predicted / r.published - 1 for r in a100_pcie_step_time()]
    assert len(errs) == 30
    assert sum(abs(e) for e in errs) / len(errs) <= 0.08
    assert max(abs(e) for e in errs) <= 0.20
