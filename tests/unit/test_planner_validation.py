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
    for r in rows:
        assert -0.15 < r.error < 0.05, (r.case, r.quantity, r.predicted, r.published)
    # and selective recompute + SP beats full recompute by about the published margin
    by = {(r.case, r.quantity.split()[1]): r for r in rows}
    for case in ("22B", "175B", "530B", "1T"):
        pred = by[(case, "full")].predicted / by[(case, "SP+selective")].predicted
        published = by[(case, "full")].published / by[(case, "SP+selective")].published
        assert pred == pytest.approx(published, rel=0.08)


def test_megatron_h100_fit_and_held_out_rows():
    eff = pub.fit_efficiency(fast=True)
    assert 0.7 < eff < 0.9
    rows = [row for row, _ in pub.megatron_h100({"efficiency": eff}, fast=True)]
    fitted = [r for r in rows if r.case in pub.FIT_ROWS]
    held = [r for r in rows if r.case not in pub.FIT_ROWS]
    assert len(held) == 4
    assert max(abs(r.error) for r in fitted) < 0.15
    assert max(abs(r.error) for r in held) < 0.25
    assert sum(abs(r.error) for r in held) / len(held) < 0.15


def test_megatron_h100_a_priori_is_optimistic_where_communication_is_hidden():
    rows = {row.case: row for row, _ in pub.megatron_h100(fast=True)}
    # the roofline with datasheet numbers over-predicts MFU (efficiency 1 is an upper bound)
    # everywhere except 32B, whose exposed 16 GB gradient reduce-scatter we over-charge
    assert all(r.error > 0 for case, r in rows.items() if case != "32B")
    assert rows["32B"].error < 0


def test_llama3_405b_mfu_within_15_percent():
    rows = pub.llama3_405b(fast=True)
    assert len(rows) == 3
    for row, plan in rows:
        assert plan.fits
        assert abs(row.error) < 0.15, (row.case, row.predicted, row.published)
