"""Schedule IR: action strings, stage graphs and placements, JSON round-trip, comm insertion."""

from __future__ import annotations

import json

import pytest

from hyperloom.pipeline import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    add_communication,
    build_schedule,
    parse_action,
    validate,
)

KINDS = [
    ("gpipe", 4, 6, 1),
    ("1f1b", 4, 8, 1),
    ("interleaved", 4, 8, 2),
    ("zb-h1", 4, 8, 1),
    ("zb-v", 4, 8, 1),
    ("dualpipe", 4, 8, 1),
    ("dualpipev", 4, 8, 1),
]


@pytest.mark.parametrize(
    "action, text",
    [
        (Action.f(1, 3), "F3@s1"),
        (Action.b(1, 3), "B3@s1"),
        (Action.w(1, 3), "W3@s1"),
        (Action.bw(2, 0), "BW0@s2"),
        (Action.fb((1, 3), (6, 0), full=False), "F3@s1+B0@s6"),
        (Action.fb((1, 3), (6, 0)), "F3@s1+BW0@s6"),
        (Action(ActionKind.SEND_F, 1, 3, peer=2), "sendF3@s1->r2"),
        (Action(ActionKind.RECV_F, 2, 3, peer=1), "recvF3@s2<-r1"),
        (Action(ActionKind.SEND_B, 2, 3, peer=1), "sendB3@s2->r1"),
        (Action(ActionKind.RECV_B, 1, 3, peer=2), "recvB3@s1<-r2"),
    ],
)
def test_action_str_and_parse_round_trip(action, text):
    assert str(action) == text
    assert parse_action(text) == action


def test_fb_parts_are_its_forward_and_backward():
    f, b = Action.fb((1, 3), (6, 0)).parts
    assert (f.kind, f.stage, f.microbatch) == (ActionKind.F, 1, 3)
    assert (b.kind, b.stage, b.microbatch) == (ActionKind.BW, 6, 0)
    assert Action(ActionKind.SEND_F, 0, 0, peer=1).parts == ()


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Action(ActionKind.F, 0, 0, peer=1), "peer"),
        (lambda: Action(ActionKind.SEND_F, 0, 0), "peer"),
        (lambda: Action(ActionKind.FB, 0, 0), "b_stage"),
        (lambda: Action(ActionKind.FB, 0, 0, 1, 1, ActionKind.W), "B or BW"),
        (lambda: parse_action("X3@s1"), "cannot parse"),
        (lambda: parse_action("sendF3@s1<-r2"), "->"),
    ],
)
def test_malformed_actions_are_rejected(make, words):
    with pytest.raises(ScheduleError, match=words):
        make()


def test_phase_tag_is_not_part_of_identity():
    assert Action.f(0, 1, phase=4) == Action.f(0, 1)


def test_standard_and_interleaved_placement():
    s = build_schedule("interleaved", 4, 8, vpp=3)
    assert s.n_stages == 12 and s.vpp == 3
    assert s.stages_of(1) == (1, 5, 9)  # rank r holds r, r+p, r+2p
    assert s.loss_stages == (11,) and s.placement[11] == 3
    assert s.next_stage(3) == 4 and s.prev_stage(0) is None


@pytest.mark.parametrize("kind", ["zb-v", "dualpipev"])
def test_v_shape_holds_first_and_last_stage_on_rank_zero(kind):
    s = build_schedule(kind, 4, 8)
    assert [s.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert s.loss_stages == (7,) and len(s.pipes) == 1 and s.model_chunks_per_rank == 2


def test_dualpipe_has_two_model_copies_in_opposite_directions():
    s = build_schedule("dualpipe", 4, 8)
    down, up = s.pipes
    assert [s.placement[x] for x in down.stages] == [0, 1, 2, 3]
    assert [s.placement[x] for x in up.stages] == [3, 2, 1, 0]
    assert down.microbatches == (0, 1, 2, 3) and up.microbatches == (4, 5, 6, 7)
    assert s.replica_of == (0, 1, 2, 3, 0, 1, 2, 3)  # stage 4 + k copies stage k
    assert s.loss_stages == (3, 7)  # each direction has its own loss stage
    # Rank r holds stage r of one copy and stage PP-1-r of the other.
    for r in range(4):
        assert sorted(s.replica_of[x] for x in s.stages_of(r)) == sorted({r, 3 - r})
    assert s.model_chunks_per_rank == 1


@pytest.mark.parametrize("kind, pp, m, vpp", KINDS)
@pytest.mark.parametrize("comm", [False, True])
def test_json_round_trip(kind, pp, m, vpp, comm):
    s = build_schedule(kind, pp, m, vpp)
    if comm:
        s = add_communication(s)
    text = s.to_json()
    back = Schedule.from_json(text)
    assert back == s
    assert [a.phase for a in back.actions[0]] == [a.phase for a in s.actions[0]]
    d = json.loads(text)
    first = d["ranks"][0]["actions"][0]
    assert {"kind", "stage", "microbatch"} <= set(first)


def test_from_json_rejects_garbage():
    with pytest.raises(ScheduleError, match="not a schedule JSON"):
        Schedule.from_json('{"name": "x"}')


def test_schedule_structure_is_checked():
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="one entry per stage"):
        Schedule(s.name, 2, 2, 2, (0,), s.pipes, s.actions)
    with pytest.raises(ScheduleError, match="2 action lists"):
        Schedule(s.name, 2, 2, 2, s.placement, s.pipes, s.actions[:1])


def _channel(sched: Schedule, src: int, dst: int) -> tuple[list, list]:
    """(messages src sends to dst, messages dst receives from src), as (kind, mb) in order."""
    sends = [
        (a.kind.value[-1], a.microbatch)
        for a in sched.actions[src]
        if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B) and a.peer == dst
    ]
    recvs = [
        (a.kind.value[-1], a.microbatch)
        for a in sched.actions[dst]
        if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B) and a.peer == src
    ]
    return sends, recvs


@pytest.mark.parametrize("kind, pp, m, vpp", KINDS)
def test_add_communication_pairs_every_send_in_order(kind, pp, m, vpp):
    compute = build_schedule(kind, pp, m, vpp)
    s = add_communication(compute)
    assert s.compute_only() == compute  # only comm was added, compute order untouched
    for src in range(pp):
        for dst in range(pp):
            sends, recvs = _channel(s, src, dst)
            assert sends == recvs, (src, dst)
    # One activation message per cross-rank stage boundary and micro-batch.
    boundaries = sum(
        len(p.microbatches)
        for p in s.pipes
        for a, b in zip(p.stages, p.stages[1:], strict=False)
        if s.placement[a] != s.placement[b]
    )
    n_send_f = sum(a.kind is ActionKind.SEND_F for acts in s.actions for a in acts)
    assert n_send_f == boundaries
    validate(s)


def test_v_turnaround_needs_no_communication():
    s = add_communication(build_schedule("zb-v", 4, 8))
    # Rank 3 holds stages 3 and 4: the turn of the V is a local hand-over.
    last = s.actions[3]
    assert not any(a.kind.is_comm and a.peer == 3 for a in last)
    assert not any(a.kind is ActionKind.SEND_F and a.stage == 3 for a in last)
    assert not any(a.kind is ActionKind.RECV_F and a.stage == 4 for a in last)


def test_receive_is_placed_just_before_its_consumer():
    s = add_communication(build_schedule("1f1b", 2, 3))
    r1 = [str(a) for a in s.actions[1]]
    assert r1[:3] == ["recvF0@s1<-r0", "F0@s1", "BW0@s1"]
    assert r1[r1.index("F1@s1") - 1] == "recvF1@s1<-r0"
    with pytest.raises(ScheduleError, match="already has"):
        add_communication(s)
