"""Generated schedules against the published closed forms, phase tables and memory bounds.

Costs are F = B = W = 1 per micro-batch of one rank's whole share of layers, zero comm cost,
so every bubble below is a small exact number (the simulator works in floats; we compare
with a tolerance far below one time unit anyway).
"""

from __future__ import annotations

import pytest

from hyperloom.pipeline import (
    ActionKind,
    Costs,
    ScheduleError,
    StageCost,
    add_communication,
    build_schedule,
    closed_form_bubble,
    simulate,
)

UNIT = Costs(f=1, b=1, w=1)


def _bubbles(kind: str, pp: int, m: int, vpp: int = 1, costs: Costs = UNIT) -> list[float]:
    return list(simulate(add_communication(build_schedule(kind, pp, m, vpp)), costs).bubble)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_1f1b_and_gpipe_bubble_is_p_minus_1_times_f_b_w(pp, mult):
    m = pp * mult + 1
    expected = (pp - 1) * (1 + 1 + 1)
    assert _bubbles("1f1b", pp, m) == pytest.approx([expected] * pp)
    assert _bubbles("gpipe", pp, m) == pytest.approx([expected] * pp)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m_over_p", [1, 2, 3])
def test_zb_h1_bubble_is_p_minus_1_times_f_b_minus_w(pp, m_over_p):
    assert _bubbles("zb-h1", pp, pp * m_over_p) == pytest.approx([(pp - 1) * (1 + 1 - 1)] * pp)


@pytest.mark.parametrize("f, b, w", [(1, 2, 1), (2, 2, 1), (1, 1, 0.5)])
def test_zb_h1_closed_form_holds_for_w_not_above_f_and_b(f, b, w):
    costs = Costs(f=f, b=b, w=w)
    assert _bubbles("zb-h1", 4, 12, costs=costs) == pytest.approx([3 * (f + b - w)] * 4)
    assert _bubbles("1f1b", 4, 12, costs=costs) == pytest.approx([3 * (f + b + w)] * 4)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("vpp", [2, 3, 4])
@pytest.mark.parametrize("m_over_p", [1, 2, 3])
def test_interleaved_bubble_is_1f1b_bubble_over_v(pp, vpp, m_over_p):
    expected = (pp - 1) * 3 / vpp
    assert _bubbles("interleaved", pp, pp * m_over_p, vpp) == pytest.approx([expected] * pp)


@pytest.mark.parametrize("pp", [2, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 2, 8])
def test_dualpipe_bubble_matches_deepseek_table(pp, extra):
    # (PP/2 - 1)(F&B + B - 3W) with B the full backward: F&B = 1 + 2, B = 2, W = 1.
    m = 2 * pp + extra
    assert _bubbles("dualpipe", pp, m) == pytest.approx([(pp // 2 - 1) * (3 + 2 - 3)] * pp)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_dualpipev_bubble_matches_table_over_half_stages(pp):
    # Same formula with PP = 2pp stages of half size: (pp - 1)(1.5 + 1 - 1.5).
    assert _bubbles("dualpipev", pp, 3 * pp) == pytest.approx([(pp - 1) * 1.0] * pp)


@pytest.mark.parametrize("kind, vpp", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_closed_form_helper_agrees_with_the_simulation(kind, vpp):
    r = simulate(build_schedule(kind, 4, 8, vpp), UNIT)
    formula, value = closed_form_bubble(r.schedule, UNIT)
    assert max(r.bubble) == pytest.approx(value) and "p-1" in formula


def test_bubble_does_not_grow_with_micro_batches_for_dualpipe_and_zb_v():
    for kind in ("dualpipe", "dualpipev", "zb-v", "zb-h1"):
        assert _bubbles(kind, 4, 8) == pytest.approx(_bubbles(kind, 4, 40)), kind


def test_work_is_the_same_for_every_schedule():
    # Stage costs are the rank share over the distinct chunks a rank holds, so all do 3m.
    for kind, vpp in [
        ("1f1b", 1),
        ("interleaved", 2),
        ("zb-v", 1),
        ("dualpipe", 1),
        ("dualpipev", 1),
        ("gpipe", 1),
        ("zb-h1", 1),
    ]:
        r = simulate(build_schedule(kind, 4, 8, vpp), UNIT)
        assert r.busy == pytest.approx([24.0] * 4), kind


# ------------------------------------------------------------------- DualPipe phase tables


def _phase_iterations(actions, phase: int) -> int:
    """Loop iterations of one DualPipe phase, counted from its actions' kinds."""
    acts = [a for a in actions if a.phase == phase]
    n = {k: sum(a.kind is k for a in acts) for k in ActionKind}
    per_phase = {
        1: n[ActionKind.F],
        2: n[ActionKind.F] / 2,
        3: n[ActionKind.W],
        4: (n[ActionKind.FB] + n[ActionKind.F]) / 2,  # middle ranks: F, BW apart once
        5: n[ActionKind.BW],
        6: (n[ActionKind.B] + n[ActionKind.BW]) / 2,
        7: n[ActionKind.W],
        8: n[ActionKind.W],
    }
    return per_phase[phase]


def _published(H: int, h: int, c_minus_pp: int) -> list[int]:
    # DualPipe's eight phase counts (deepseek-ai/DualPipe `dualpipe.py` `step`; arXiv 2412.19437
    # §3.2.1): nF0, nF0F1, nB1W1F1, nF0B1F1B0, nB1F1B0, nB1B0, nWB0, nW
    return [
        2 * (H - h - 1),
        h + 1,
        H - h - 1,
        c_minus_pp + h + 1,
        H - h - 1,
        h + 1,
        H - h - 1,
        h + 1,
    ]


def test_dualpipe_phase_counts_pp8_m20_every_rank():
    pp, m = 8, 20
    s = build_schedule("dualpipe", pp, m)
    assert [_phase_iterations(s.actions[0], p) for p in range(1, 9)] == [6, 1, 3, 3, 3, 1, 3, 1]
    for r in range(pp):
        h = min(r, pp - 1 - r)
        counts = [_phase_iterations(s.actions[r], p) for p in range(1, 9)]
        assert counts == _published(pp // 2, h, m // 2 - pp), r
        # Ten forwards per direction on every rank.
        fwd = [p.stage for a in s.actions[r] for p in a.parts if p.kind is ActionKind.F]
        assert sorted(fwd.count(x) for x in set(fwd)) == [10, 10]


@pytest.mark.parametrize("pp, m", [(4, 8), (4, 10), (8, 16), (8, 19), (3, 7)])
def test_dualpipev_phase_counts(pp, m):
    s = build_schedule("dualpipev", pp, m)
    for r in range(pp):
        counts = [_phase_iterations(s.actions[r], p) for p in range(1, 9)]
        assert counts == _published(pp, r, m - 2 * pp), r


def test_dualpipe_phase_structure():
    s = build_schedule("dualpipe", 8, 20)
    for r, acts in enumerate(s.actions):
        middle = r in (3, 4)
        p4 = [a for a in acts if a.phase == 4]
        kinds = [a.kind for a in p4]
        if middle:  # F0 and BW1 not overlapped, then pairs
            assert kinds[:2] == [ActionKind.F, ActionKind.BW]
            assert set(kinds[2:]) == {ActionKind.FB}
        else:
            assert set(kinds) == {ActionKind.FB}
        # Each pair overlaps the two directions: its halves sit on different pipes.
        for a in p4:
            if a.kind is ActionKind.FB:
                assert s.pipe_of(a.stage) != s.pipe_of(a.b_stage)
        assert {a.kind for a in acts if a.phase == 8} == {ActionKind.W}
        assert {a.kind for a in acts if a.phase == 1} <= {ActionKind.F}
        # W is deferred only where B ran alone (phases 3, 6, 7): FIFO order of the B's.
        split_b = [(a.stage, a.microbatch) for a in acts if a.kind is ActionKind.B]
        ws = [(a.stage, a.microbatch) for a in acts if a.kind is ActionKind.W]
        assert ws == split_b


# ------------------------------------------------------------------------------ memory


def test_peak_in_flight_1f1b_is_p_and_dualpipe_p_plus_1():
    for pp in (2, 4, 8):
        r = simulate(build_schedule("1f1b", pp, 3 * pp))
        assert r.peak_in_flight[0] == pp
        assert r.peak_in_flight == tuple(pp - i for i in range(pp))
        d = simulate(build_schedule("dualpipe", pp, 3 * pp if pp % 2 == 0 else 0))
        assert d.peak_in_flight == (pp + 1,) * pp


def test_zb_schedules_keep_1f1b_memory():
    assert simulate(build_schedule("zb-h1", 4, 12)).peak_in_flight == (4, 3, 2, 1)
    zbv = simulate(build_schedule("zb-v", 4, 12))
    assert zbv.peak_activation_memory == pytest.approx((4.0,) * 4)  # 8 half-size chunks
    assert simulate(build_schedule("zb-h1", 4, 12)).peak_w_pending == (1, 2, 3, 4)


# ------------------------------------------------------------------------- build errors


@pytest.mark.parametrize(
    "kind, pp, m, vpp, message",
    [
        ("interleaved", 4, 6, 2, "multiple of pp=4: got 6, try 4 or 8"),
        ("interleaved", 4, 8, 1, "needs --vpp >= 2"),
        ("1f1b", 4, 8, 2, "--vpp must be 1, got 2; use 'interleaved'"),
        ("zb-v", 4, 8, 3, "zb-v places 2 stages per rank .* --vpp must be 2, got 3"),
        ("zb-v", 1, 8, 1, "zb-v needs pp >= 2"),
        ("dualpipe", 3, 12, 1, "DualPipe needs an even pp"),
        ("dualpipe", 4, 6, 1, "micro-batches >= 2\\*pp; got pp=4, m=6"),
        ("dualpipe", 4, 9, 1, "an even number of micro-batches"),
        ("dualpipev", 4, 7, 1, "DualPipeV needs micro-batches >= 2\\*pp = 8"),
        ("nope", 4, 8, 1, "unknown schedule 'nope'; choose one of gpipe, 1f1b"),
        ("1f1b", 0, 8, 1, "need pp >= 1"),
    ],
)
def test_invalid_combinations_raise_schedule_error(kind, pp, m, vpp, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(kind, pp, m, vpp)
    assert issubclass(ScheduleError, ValueError)


# ----------------------------------------------------------------------------- simulator


def test_comm_latency_delays_each_hop_and_both_forms_agree():
    s = build_schedule("1f1b", 4, 8)
    slow = Costs(comm=0.5)
    a, b = simulate(s, slow), simulate(add_communication(s), slow)
    assert a.makespan == pytest.approx(b.makespan)
    # At least: the first forward reaches the last rank after 3 hops, its gradient comes back
    # in 3; 1F1B's steady state pays more, as each backward waits for a round trip.
    assert a.makespan >= simulate(s).makespan + 2 * 3 * 0.5


def test_per_stage_costs_and_fb_overlap():
    s = build_schedule("1f1b", 2, 4)
    even = simulate(s, Costs(per_stage={0: StageCost(1, 1, 1), 1: StageCost(1, 1, 1)}))
    assert even.makespan == simulate(s).makespan
    slow = simulate(s, Costs(per_stage={0: StageCost(1, 1, 1), 1: StageCost(3, 3, 3)}))
    assert slow.busy == (12.0, 36.0) and slow.makespan >= 36 + 1  # rank 1 waits for F0 first
    d = build_schedule("dualpipe", 4, 8)
    assert simulate(d, Costs(fb_overlap=0.5)).makespan < simulate(d).makespan
    with pytest.raises(ScheduleError, match="costs must be"):
        Costs(f=-1)
