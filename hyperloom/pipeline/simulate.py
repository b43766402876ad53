"""Time a schedule: lay per-action costs onto the IR and replay it event by event.

The same replay as `validate`, with durations from `Costs` and a p2p latency across ranks;
it returns every action's start and end and per rank the busy time, bubble and peak
activations. `Costs.f/b/w` are per micro-batch for one rank's whole share of layers (the
papers' unit), divided among the chunks a rank holds, so every schedule does the same work
and bubbles compare directly; `per_stage` substitutes measured times (the planner's path).

Closed forms (`closed_form_bubble`), F = B = W per rank share, zero comm cost:

- GPipe, 1F1B: (p - 1)(F + B + W)                     (arXiv 2104.04473 §2.2)
- interleaved 1F1B: (p - 1)(F + B + W) / v, m % p == 0     (same, §2.2.2)
- ZB-H1: (p - 1)(F + B - W)                           (arXiv 2401.10241 §3.1)
- DualPipe: (p/2 - 1)(F&B + B - 3W), B the full backward  (arXiv 2412.19437 Table 2);
  DualPipeV the same over its 2p half-sized stages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from hyperloom.pipeline.ir import Action, ActionKind, Schedule, ScheduleError
from hyperloom.pipeline.validate import Event, replay


@dataclass(frozen=True)
class StageCost:
    """Absolute time of one action on one stage for one micro-batch."""

    f: float
    b: float
    w: float


@dataclass(frozen=True)
class Costs:
    """Action costs. f/b/w: per micro-batch, one rank's whole share of layers."""

    f: float = 1.0
    b: float = 1.0  # input-gradient backward
    w: float = 1.0  # weight-gradient backward
    comm: float = 0.0  # latency of one p2p transfer between ranks
    fb_overlap: float = 1.0  # an FB pair takes fb_overlap * (F + its backward); <1 = overlap wins
    per_stage: Mapping[int, StageCost] | None = None  # measured per-stage times (overrides f/b/w)

    def __post_init__(self) -> None:
        if min(self.f, self.b, self.w, self.comm) < 0 or self.fb_overlap <= 0:
            raise ScheduleError(f"costs must be >= 0 (fb_overlap > 0), got {self}")

    def stage(self, sched: Schedule, s: int) -> StageCost:
        if self.per_stage is not None:
            for key in (s, sched.replica_of[s]):  # DualPipe's copy costs what its original does
                if key in self.per_stage:
                    return self.per_stage[key]
        k = sched.model_chunks_per_rank
        return StageCost(self.f / k, self.b / k, self.w / k)

    def duration(self, sched: Schedule, a: Action) -> float:
        if a.kind.is_comm:
            return 0.0
        if a.kind is ActionKind.FB:
            return self.fb_overlap * sum(self.duration(sched, p) for p in a.parts)
        c = self.stage(sched, a.stage)
        return {
            ActionKind.F: c.f,
            ActionKind.B: c.b,
            ActionKind.W: c.w,
            ActionKind.BW: c.b + c.w,
        }[a.kind]


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    costs: Costs
    events: tuple[tuple[Event, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_w_pending: tuple[int, ...]

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> tuple[float, ...]:
        return tuple(b / self.makespan if self.makespan else 0.0 for b in self.bubble)

    @property
    def total_bubble_fraction(self) -> float:
        """Idle share of all ranks' time, sum(bubble) / (pp * makespan)."""
        return sum(self.bubble) / (len(self.busy) * self.makespan) if self.makespan else 0.0

    @property
    def peak_activation_memory(self) -> tuple[float, ...]:
        """Peak in-flight activations scaled by stage size, in micro-batches of a rank's
        whole share of layers (the unit where 1F1B's rank 0 holds p; ZB-V holds p too)."""
        k = self.schedule.model_chunks_per_rank
        return tuple(p / k for p in self.peak_in_flight)

    def counts(self, rank: int) -> Counter[str]:
        """Compute actions of one rank by kind ('F', 'B', 'W', 'BW', 'FB')."""
        return Counter(e.action.kind.value for e in self.events[rank] if e.action.kind.is_compute)


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Validate and time `schedule` (with or without comm actions) under `costs`."""
    costs = costs or Costs()
    rep = replay(schedule, lambda a: costs.duration(schedule, a), costs.comm)
    ends = [e.end for evs in rep.events for e in evs]
    busy = tuple(
        sum(e.end - e.start for e in evs if e.action.kind.is_compute) for evs in rep.events
    )
    return SimResult(
        schedule=schedule,
        costs=costs,
        events=rep.events,
        makespan=max(ends, default=0.0),
        busy=busy,
        peak_in_flight=rep.peak_in_flight,
        peak_w_pending=rep.peak_w_pending,
    )


def closed_form_bubble(schedule: Schedule, costs: Costs) -> tuple[str, float] | None:
    """(formula, value) of the published per-rank bubble for this schedule, if there is one."""
    p, v, m = schedule.pp, schedule.vpp, schedule.microbatches
    f, b, w = costs.f, costs.b, costs.w
    kind = schedule.name
    if costs.per_stage is not None or costs.comm:
        return None  # the closed forms assume uniform stages and free communication
    if kind in ("gpipe", "1f1b"):
        return "(p-1)(F+B+W)", (p - 1) * (f + b + w)
    if kind == "interleaved" and m % p == 0:
        return "(p-1)(F+B+W)/v", (p - 1) * (f + b + w) / v
    if kind == "zb-h1":
        return "(p-1)(F+B-W)", (p - 1) * (f + b - w)
    if kind in ("dualpipe", "dualpipev"):
        # Chunk costs: DualPipe's stage is a rank's share; DualPipeV's is half of it, and its
        # "PP" is the number of stages, 2p.
        k = schedule.model_chunks_per_rank
        cf, cb, cw = f / k, b / k, w / k
        half = p // 2 if kind == "dualpipe" else p
        fb = costs.fb_overlap * (cf + cb + cw)
        return "(PP/2-1)(F&B+B-3W)", (half - 1) * (fb + (cb + cw) - 3 * cw)
    return None
