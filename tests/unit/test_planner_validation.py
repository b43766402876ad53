"""Published numbers, within the tolerances stated in docs/planner.md.

These pin the planner to Megatron-LM's H100 weak-scaling table, Korthikanti et al. 2022
(A100: Table 5 iteration times, Figure 1 memory) and Llama 3 405B's MFU. The replays use the
fast (extrapolated) path; `test_planner_simulate` holds it to the exact one.
"""

from __future__ import annotations

import pytest

from hyperloom.planner import published as pub


@pytest.fixture(scope="module")
def korthikanti():
    return [row for row, _ in pub.korthikanti_a100(fast=True)]


def test_korthikanti_activation_memory_within_6_percent(korthikanti):
    rows = [r for r in korthikanti if r.quantity.startswith("activations")]
    assert len(rows) == 8
    for r in rows:
        assert abs(r.error) < 0.06, (r.case, r.quantity, r.predicted, r.published)


def test_korthikanti_model_states_within_10_percent(korthikanti):
    # Figure 1 counts 18 B x 12Lh^2/(t*p); we also hold the embedding on stage 0 (+1.5..8%).
    for r in (r for r in korthikanti if r.quantity.startswith("params")):
        assert 0 < r.error < 0.10, (r.case, r.predicted, r.published)


def test_korthikanti_iteration_times_within_15_percent(korthikanti):
    rows = [r for r in korthikanti if r.quantity.startswith("time")]
    assert len(rows) == 8
    for r in rows:  # -11% to +3% with the MAMF-anchored kernels; -5% to +9% with the measured
        assert -0.10 < r.error < 0.10, (r.case, r.quantity, r.predicted, r.published)
    # and selective recompute + SP beats full recompute by about the published margin
    by = {(r.case, r.quantity.split()[1]): r for r in rows}
    for case in ("22B", "175B", "530B", "1T"):
        pred = by[(case, "full")].predicted / by[(case, "SP+selective")].predicted
        published = by[(case, "full")].published / by[(case, "SP+selective")].published
        assert pred == pytest.approx(published, rel=0.08)


def test_megatron_h100_fit_and_held_out_rows():
    # the h100 profile's step_eff is this fit, made once: refitted on top it stays about 1
    eff = pub.fit_efficiency(fast=True)
    assert 0.95 < eff < 1.05
    rows = [row for row, _ in pub.megatron_h100({"efficiency": eff}, fast=True)]
    fitted = [r for r in rows if r.case in pub.FIT_ROWS]
    held = [r for r in rows if r.case not in pub.FIT_ROWS]
    assert len(held) == 4
    assert max(abs(r.error) for r in fitted) < 0.15
    assert max(abs(r.error) for r in held) < 0.25
    assert sum(abs(r.error) for r in held) / len(held) < 0.15


def test_megatron_h100_roofline_is_a_bound_and_the_prediction_is_not():
    from hyperloom.planner.simulate import with_roofline

    pairs = pub.megatron_h100(fast=True)
    # the roofline (every efficiency 1) over-predicts MFU on every row (by 7% on 32B, whose
    # exposed gradient reduce-scatter stays at the roofline, 30% or more elsewhere)
    for row, plan in pairs:
        bound = with_roofline(plan).roofline_mfu
        assert bound > (1.05 if row.case == "32B" else 1.3) * row.published, row.case
    # the realistic prediction is within 25% everywhere (32B: its exposed 16 GB gradient
    # reduce-scatter on one NIC per GPU, which Megatron evidently hides, is the worst)
    errors = {row.case: row.error for row, _ in pairs}
    assert max(abs(e) for e in errors.values()) < 0.25
    assert min(errors, key=errors.get) == "32B"


def test_llama3_405b_mfu_within_15_percent():
    rows = pub.llama3_405b(fast=True)  # no recomputation, as the report describes
    assert len(rows) == 3
    for row, plan in rows:
        assert plan.strategy.recompute == "none"
        assert abs(row.error) < 0.15, (row.case, row.predicted, row.published)
    # our memory model (every saved tensor of every in-flight micro-batch) needs full
    # recomputation to fit them, which under-predicts: the policy is the largest unknown
    fitting = pub.llama3_405b(fast=True, policies=pub.LLAMA3_FITTING)
    assert all(p.fits and p.strategy.recompute == "full" for _, p in fitting)
    assert all(f.error < r.error for (f, _), (r, _) in zip(fitting, rows, strict=True))


def test_held_out_nvidia_runs_meet_the_issue_targets():
    """NVIDIA's Megatron-Core FP8 runs on H100 and B200, never used to set a planner number:
    mean |error| of the step time within 8%, every row within 10% (measured: 6.1% mean,
    -8.2%..+8.2%)."""
    rows = [r for r, _ in pub.nemo_fp8(fast=True)]
    assert len(rows) == 13 and {r.case.split()[0] for r in rows} == {"h100", "b200"}
    errors = [abs(r.error) for r in rows]
    assert sum(errors) / len(errors) < 0.08
    assert max(errors) < 0.10, [(r.case, round(r.error, 3)) for r in rows]


def test_held_out_torchtitan_a100_meets_the_targets_with_its_eager_bytes():
    """torchtitan's eager FSDP2 runs on 64 A100s (validation 6b): every step predicted fast,
    now within the issue's targets (mean 8%, every row 20%) since the A100's kernels come from
    the measured PCIe part (14.4% / -19.3% with the MAMF-anchored ones); the eager elementwise
    bytes still bring each row closer than the fused ones."""
    eager = [r for r, _ in pub.torchtitan_a100(fast=True)]
    fused = [r for r, _ in pub.torchtitan_a100(fast=True, eager=False)]
    for e, f in zip(eager, fused, strict=True):
        assert -0.20 < f.error < e.error < 0.0, (e.case, e.error, f.error)
    assert sum(abs(r.error) for r in eager) / len(eager) <= 0.08
