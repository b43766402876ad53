"""The two-lane overlap (`parallel.overlap.Duet`) and the schedule pass that forms its pairs
(`pipeline.schedules.pair_forward_backward`), without process groups: a fake collective
stands for an all-to-all in flight."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

from hyperloom.parallel import overlap
from hyperloom.pipeline import ActionKind, add_communication, simulate, validate
from hyperloom.pipeline.schedules import build_schedule, pair_forward_backward


class FakeWork:
    """An async collective that completes when `wait` is called (records who waited)."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"{self.name} done")


def lane(log: list, name: str, comms: int):
    def run():
        for i in range(comms + 1):
            log.append(f"{name} compute {i}")
            if i < comms:
                overlap.wait_overlapped(FakeWork(log, f"{name} comm {i}"), "all-to-all")

    return run


def test_lanes_alternate_at_each_collective():
    log: list[str] = []
    duet = overlap.Duet(("F", "B"))
    duet.run(lane(log, "F", 2), lane(log, "B", 2))
    assert log == [
        "F compute 0",  # F starts a collective and hands over ...
        "B compute 0",  # ... B computes while it is in flight, starts its own, hands back
        "F comm 0 done",
        "F compute 1",
        "B comm 0 done",
        "B compute 1",
        "F comm 1 done",
        "F compute 2",  # F ends: B's last collective has no one to hide behind
        "B comm 1 done",
        "B compute 2",
    ]
    comms = [s for s in duet.trace if s.kind == "all-to-all"]
    assert len(comms) == 4 and [s.lane for s in comms] == [0, 1, 0, 1]
    assert not overlap.running()


def test_a_lane_without_collectives_runs_whole():
    log: list[str] = []
    overlap.Duet().run(lane(log, "F", 0), lane(log, "B", 1))
    assert log == ["F compute 0", "B compute 0", "B comm 0 done", "B compute 1"]


def test_stats_count_exposed_and_hidden_time():
    overlap.STATS.reset()
    log: list[str] = []
    overlap.wait_overlapped(FakeWork(log, "alone"))  # no duet: all of it exposed
    assert overlap.STATS.count == 1 and overlap.STATS.hidden_by_duet == 0
    overlap.Duet().run(lane(log, "F", 1), lane(log, "B", 1))
    assert overlap.STATS.count == 3
    assert overlap.STATS.hidden_by_duet == 2  # F computed its last part during B's
    assert overlap.STATS.paired_in_flight_s >= overlap.STATS.paired_exposed_s >= 0


def test_lanes_see_the_callers_context_and_grad_mode():
    var = contextvars.ContextVar("var", default="unset")
    var.set("caller")
    seen = []

    def probe():
        seen.append((var.get(), torch.is_grad_enabled(), threading.current_thread().name))

    with torch.no_grad():
        overlap.Duet(("F", "B")).run(probe, probe)
    assert [s[:2] for s in seen] == [("caller", False), ("caller", False)]
    assert seen[0][2] != seen[1][2]  # two threads


def test_an_error_in_a_lane_reaches_the_caller_and_the_other_lane_finishes():
    done = []

    def bad():
        raise ValueError("lane failed")

    with pytest.raises(ValueError, match="lane failed"):
        overlap.Duet().run(bad, lambda: done.append(1))
    assert done == [1] and not overlap.running()
    with pytest.raises(RuntimeError, match="do not nest"):
        overlap.Duet().run(lambda: overlap.Duet().run(print, print), print)


@pytest.mark.parametrize(
    ("kind", "pp", "m", "vpp", "pairs"),
    [
        ("interleaved", 2, 8, 2, True),
        ("interleaved", 4, 8, 2, True),
        ("zb-v", 2, 8, 1, True),
        ("1f1b", 4, 8, 1, False),  # each pair would wait for its neighbour's pair
        ("zb-h1", 4, 8, 1, False),
    ],
)
def test_pairs_form_only_where_they_delay_no_neighbour(kind, pp, m, vpp, pairs):
    plain = build_schedule(kind, pp, m, vpp)
    paired = pair_forward_backward(plain)
    fbs = [a for acts in paired.actions for a in acts if a.kind is ActionKind.FB]
    assert bool(fbs) == pairs
    for a in fbs:  # a forward beside a backward of another micro-batch
        f, b = a.parts
        assert f.kind is ActionKind.F and b.kind in (ActionKind.B, ActionKind.BW)
        assert f.microbatch != b.microbatch
    # same work, no longer under unit costs, and it runs with its communication
    assert simulate(paired).makespan <= simulate(plain).makespan
    assert sorted(str(p) for acts in paired.actions for a in acts for p in a.parts) == sorted(
        str(p) for acts in plain.actions for a in acts for p in a.parts
    )
    validate(add_communication(paired))


def test_dualpipe_keeps_its_own_pairs():
    plain = build_schedule("dualpipe", 4, 8)
    assert pair_forward_backward(plain) is plain
