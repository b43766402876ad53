"""The validator accepts every generated schedule and rejects hand-broken ones, precisely."""

from __future__ import annotations

import pytest

from hyperloom.pipeline import (
    Pipe,
    Schedule,
    ScheduleError,
    add_communication,
    build_schedule,
    parse_actions,
    standard_placement,
    validate,
)


def _sweep() -> list[tuple[str, int, int, int]]:
    """(kind, pp, m, vpp) over pp in {2, 3, 4, 8}, vpp in {1, 2, 3}, m valid for each kind."""
    cases = []
    for pp in (2, 3, 4, 8):
        for m in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp - 1, 2 * pp, 3 * pp + 1} - {0}):
            cases += [(k, pp, m, 1) for k in ("gpipe", "1f1b", "zb-h1", "zb-v")]
        for vpp in (2, 3):
            cases += [("interleaved", pp, m, vpp) for m in (pp, 2 * pp, 3 * pp)]
            cases += [("zb-v", pp, 2 * pp, 2)] if vpp == 2 else []
        for m in range(2 * pp, 3 * pp + 2):
            cases.append(("dualpipev", pp, m, 1))
            if pp % 2 == 0 and m % 2 == 0:
                cases.append(("dualpipe", pp, m, 1))
    return cases


SWEEP = _sweep()


def test_sweep_covers_every_kind_and_vpp():
    assert {c[0] for c in SWEEP} == {
        "gpipe",
        "1f1b",
        "interleaved",
        "zb-h1",
        "zb-v",
        "dualpipe",
        "dualpipev",
    }
    assert {c[3] for c in SWEEP if c[0] == "interleaved"} == {2, 3}
    assert len(SWEEP) > 150


@pytest.mark.parametrize("kind, pp, m, vpp", SWEEP)
def test_validator_accepts_every_generated_schedule(kind, pp, m, vpp):
    s = build_schedule(kind, pp, m, vpp)
    report = validate(s)
    with_comm = validate(add_communication(s))
    assert report.peak_in_flight == with_comm.peak_in_flight
    assert all(1 <= p <= m * s.vpp for p in report.peak_in_flight)


# ----------------------------------------------------------------------------- broken ones


def _hand(pp: int, m: int, *ranks: str, vpp: int = 1) -> Schedule:
    """A standard-placement schedule written as one string of actions per rank."""
    n = pp * vpp
    return Schedule(
        "hand",
        pp,
        n,
        m,
        standard_placement(pp, vpp),
        (Pipe(tuple(range(n)), tuple(range(m))),),
        tuple(parse_actions(r) for r in ranks),
    )


GOOD_1F1B = ("F0@s0 F1@s0 BW0@s0 BW1@s0", "F0@s1 BW0@s1 F1@s1 BW1@s1")


def test_hand_written_1f1b_is_valid():
    assert validate(_hand(2, 2, *GOOD_1F1B)).peak_in_flight == (2, 1)


@pytest.mark.parametrize(
    "ranks, message",
    [
        # missing: rank 1 never runs the forward of micro-batch 1
        (
            ("F0@s0 F1@s0 BW0@s0 BW1@s0", "F0@s1 BW0@s1 BW1@s1"),
            "micro-batch 1 at stage 1 .* 0 forwards",
        ),
        # duplicated backward
        (("F0@s0 F1@s0 BW0@s0 BW1@s0 BW1@s0", "F0@s1 BW0@s1 F1@s1 BW1@s1"), "2 BW"),
        # split and full backward mixed for one micro-batch
        (("F0@s0 F1@s0 BW0@s0 B1@s0 BW1@s0", "F0@s1 BW0@s1 F1@s1 BW1@s1"), "1 BW, 1 B and 0 W"),
        # backward before forward on the same rank
        (
            ("F0@s0 BW1@s0 F1@s0 BW0@s0", "F0@s1 BW0@s1 F1@s1 BW1@s1"),
            "BW1@s0: backward of micro-batch 1 before its forward",
        ),
        # a stage run by a rank that does not hold it
        (("F0@s0 F1@s0 BW0@s0 BW1@s0 F0@s1", "BW0@s1 F1@s1 BW1@s1"), "does not hold s1"),
        # cross-rank wait cycle: rank 1 wants F1 first, rank 0 sends it only after B0
        (("F0@s0 BW0@s0 F1@s0 BW1@s0", "F1@s1 F0@s1 BW0@s1 BW1@s1"), "deadlock: rank 0 at BW0@s0"),
    ],
)
def test_broken_compute_schedules_are_rejected(ranks, message):
    with pytest.raises(ScheduleError, match=message):
        validate(_hand(2, 2, *ranks))


def test_weight_gradient_before_its_backward_is_rejected():
    s = build_schedule("zb-h1", 2, 2)
    rank0 = [str(a) for a in s.actions[0]]
    b, w = rank0.index("B0@s0"), rank0.index("W0@s0")
    rank0[b], rank0[w] = rank0[w], rank0[b]
    broken = s.with_actions([parse_actions(" ".join(rank0)), s.actions[1]])
    with pytest.raises(ScheduleError, match="W0@s0: weight gradient before"):
        validate(broken)


def _comm_ranks(s: Schedule) -> list[list[str]]:
    return [[str(a) for a in acts] for acts in s.actions]


def _rebuild(s: Schedule, ranks: list[list[str]]) -> Schedule:
    return s.with_actions([parse_actions(" ".join(r)) for r in ranks])


def test_receive_hoisted_above_a_send_deadlocks():
    s = add_communication(build_schedule("1f1b", 2, 4))
    ranks = _comm_ranks(s)
    assert ranks[0][:2] == ["F0@s0", "sendF0@s0->r0".replace("r0", "r1")]
    # Rank 0 now waits for micro-batch 0's gradient before sending its activation.
    ranks[0].remove("recvB0@s0<-r1")
    ranks[0].insert(0, "recvB0@s0<-r1")
    with pytest.raises(
        ScheduleError, match=r"deadlock: rank 0 at recvB0@s0<-r1 .*rank 1 at recvF0"
    ):
        validate(_rebuild(s, ranks))


def test_swapped_sends_are_an_order_mismatch():
    s = add_communication(build_schedule("1f1b", 2, 4))
    ranks = _comm_ranks(s)
    # F0 F1 sendF1 sendF0: rank 1 would read micro-batch 1's activation as micro-batch 0's.
    ranks[0][:4] = ["F0@s0", "F1@s0", "sendF1@s0->r1", "sendF0@s0->r1"]
    with pytest.raises(ScheduleError, match="same order"):
        validate(_rebuild(s, ranks))


def test_missing_receive_and_unmatched_send_are_rejected():
    s = add_communication(build_schedule("1f1b", 2, 2))
    ranks = _comm_ranks(s)
    no_recv = [ranks[0], [a for a in ranks[1] if a != "recvF1@s1<-r0"]]
    with pytest.raises(ScheduleError, match="F1@s1: needs data from rank 0 but has no earlier"):
        validate(_rebuild(s, no_recv))
    ranks[1] = [a for a in ranks[1] if a != "sendB1@s1->r0"]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 at recvB1@s0<-r1"):
        validate(_rebuild(s, ranks))
    extra = _comm_ranks(s)
    extra[0].append("sendF1@s0->r1")
    with pytest.raises(ScheduleError, match="sends nobody receives"):
        validate(_rebuild(s, extra))


def test_send_to_the_wrong_peer_is_rejected():
    s = add_communication(build_schedule("1f1b", 3, 3))
    ranks = _comm_ranks(s)
    ranks[0] = [a.replace("->r1", "->r2") for a in ranks[0]]
    with pytest.raises(ScheduleError, match="peer is not the rank of the neighbouring stage"):
        validate(_rebuild(s, ranks))


def test_activation_bound():
    s = build_schedule("1f1b", 4, 8)
    assert validate(s, max_in_flight=4).peak_in_flight == (4, 3, 2, 1)
    with pytest.raises(ScheduleError, match="rank 0, F3@s0: 4 activations in flight, bound is 3"):
        validate(s, max_in_flight=3)
    gp = build_schedule("gpipe", 4, 8)
    assert validate(gp).peak_in_flight == (8, 8, 8, 8)  # GPipe holds every micro-batch
    with pytest.raises(ScheduleError, match="rank 3, F7@s3: 8 activations in flight, bound is 7"):
        validate(gp, max_in_flight=[8, 8, 8, 7])  # per-rank bounds
    # DualPipe's rank 0 reaches PP + 1 only inside an F&B pair: the bound sees the pair's peak.
    dp = build_schedule("dualpipe", 4, 8)
    with pytest.raises(ScheduleError, match=r"rank 0, F3@s0\+BW5@s7: 5 activations in flight"):
        validate(dp, max_in_flight=[4, 5, 5, 5])
