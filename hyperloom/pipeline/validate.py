"""Check that a schedule can run: every dependency met, no deadlock, bounded activations.

A symbolic replay: each rank runs its list in order, and an action starts once its
dependencies are done -- F(m, s) needs F(m, prev(s)); B/BW(m, s) need F(m, s) and the backward
of (m, next(s)); W needs its B; an FB pair needs both halves' inputs. With communication
actions, a cross-rank dependency must arrive through an earlier receive, receives wait for
their send, and each rank pair's messages arrive in send order (`comm.py`). This is a Kahn
process network, so whether the replay finishes does not depend on the interleaving: a stuck
state is a real deadlock for any executor keeping the contract.

It also checks coverage (each unit has one F and one B + W, or one BW) and counts in-flight
activations per rank (an FB pair counts its forward before its backward frees one: DualPipe's
PP + 1), with B-done, W-pending units counted apart (`peak_w_pending`, Zero Bubble's
M_W < M_B). Given durations, the same replay times `simulate`.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hyperloom.pipeline.ir import Action, ActionKind, Schedule, ScheduleError

_BACKWARD = (ActionKind.B, ActionKind.BW)


@dataclass(frozen=True)
class Event:
    """One executed action: when it started and ended on its rank."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class ValidationReport:
    peak_in_flight: tuple[int, ...]
    peak_w_pending: tuple[int, ...]
    events: tuple[tuple[Event, ...], ...]


def check_coverage(schedule: Schedule) -> None:
    """Every (stage, mb) has exactly one F and one B + one W, or one BW; stages on their rank."""
    sched = schedule
    counts: Counter[tuple[ActionKind, int, int]] = Counter()
    for rank, acts in enumerate(sched.actions):
        for a in acts:
            stages = [a.stage] + ([a.b_stage] if a.b_stage is not None else [])
            for s in stages:
                if not 0 <= s < sched.n_stages or sched.placement[s] != rank:
                    raise ScheduleError(
                        f"{sched.name}: rank {rank} runs {a} but does not hold s{s}"
                    )
            for part in a.parts:
                if part.microbatch not in sched.pipe_of(part.stage).microbatches:
                    raise ScheduleError(
                        f"{sched.name}: {part} on rank {rank}: micro-batch {part.microbatch} "
                        f"does not flow through stage {part.stage}"
                    )
                counts[(part.kind, part.stage, part.microbatch)] += 1
    for pipe in sched.pipes:
        for s in pipe.stages:
            for m in pipe.microbatches:
                n = {k: counts[(k, s, m)] for k in (ActionKind.F, ActionKind.B, ActionKind.W)}
                n_bw = counts[(ActionKind.BW, s, m)]
                where = f"{sched.name}: micro-batch {m} at stage {s} (rank {sched.placement[s]})"
                if n[ActionKind.F] != 1:
                    raise ScheduleError(f"{where} has {n[ActionKind.F]} forwards, needs 1")
                split = (n[ActionKind.B], n[ActionKind.W])
                if not ((n_bw == 1 and split == (0, 0)) or (n_bw == 0 and split == (1, 1))):
                    raise ScheduleError(
                        f"{where} has {n_bw} BW, {split[0]} B and {split[1]} W; needs one BW "
                        f"or one B and one W"
                    )


class _Replay:
    """Runs the ranks' programs; `duration` gives each action's time (0 for a pure check)."""

    def __init__(self, sched: Schedule, duration: Callable[[Action], float], latency: float):
        self.s, self.duration, self.latency = sched, duration, latency
        self.comm = sched.has_comm
        self.f_end: dict[tuple[int, int], float] = {}  # (stage, mb) -> end time
        self.b_end: dict[tuple[int, int], float] = {}
        self.split_b: set[tuple[int, int]] = set()
        self.received: dict[tuple[ActionKind, int, int], float] = {}  # recv kind, stage, mb
        self.channels: dict[tuple[int, int], deque[tuple[Action, float]]] = {}
        n = sched.pp
        self.pc, self.clock = [0] * n, [0.0] * n
        self.in_flight, self.w_pending = [0] * n, [0] * n
        self.peak, self.peak_w = [0] * n, [0] * n
        self.events: list[list[Event]] = [[] for _ in range(n)]

    def _err(self, rank: int, act: Action, msg: str) -> ScheduleError:
        return ScheduleError(f"{self.s.name}: rank {rank}, {act}: {msg}")

    def _dep(self, rank: int, act: Action, part: Action, other: int, kind: str) -> float | str:
        """Ready time of the tensor `part` needs from stage `other`, or why it must wait."""
        done = self.f_end if kind == "F" else self.b_end
        src = self.s.placement[other]
        key = (other, part.microbatch)
        if src == rank:
            if key not in done:
                raise self._err(
                    rank, act, f"runs before {kind}{part.microbatch}@s{other} (same rank)"
                )
            return done[key]
        if self.comm:
            rk = ActionKind.RECV_F if kind == "F" else ActionKind.RECV_B
            got = self.received.get((rk, part.stage, part.microbatch))
            if got is None:
                raise self._err(
                    rank, act, f"needs data from rank {src} but has no earlier receive for it"
                )
            return got
        if key not in done:
            return f"waits for {kind}{part.microbatch}@s{other} on rank {src}"
        return done[key] + self.latency

    def _ready(self, rank: int, act: Action) -> float | str:
        """Start time of `act` on `rank`, a reason to wait, or raise on an ordering error."""
        s, t = self.s, self.clock[rank]
        if act.kind.is_comm:
            return self._comm_ready(rank, act)
        for part in act.parts:
            key = (part.stage, part.microbatch)
            if part.kind is ActionKind.F:
                prv = s.prev_stage(part.stage)
                dep = t if prv is None else self._dep(rank, act, part, prv, "F")
            elif part.kind in _BACKWARD:
                if key not in self.f_end:
                    raise self._err(
                        rank, act, f"backward of micro-batch {part.microbatch} before its forward"
                    )
                nxt = s.next_stage(part.stage)
                dep = self.f_end[key] if nxt is None else self._dep(rank, act, part, nxt, "B")
            else:  # W
                if key not in self.split_b:
                    raise self._err(
                        rank, act, "weight gradient before its input-gradient backward B"
                    )
                dep = self.b_end[key]
            if isinstance(dep, str):
                return dep
            t = max(t, dep)
        return t

    def _comm_ready(self, rank: int, act: Action) -> float | str:
        s, key = self.s, (act.stage, act.microbatch)
        if act.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            fwd = act.kind is ActionKind.SEND_F
            nb = s.next_stage(act.stage) if fwd else s.prev_stage(act.stage)
            if nb is None or s.placement[nb] != act.peer or act.peer == rank:
                raise self._err(rank, act, "peer is not the rank of the neighbouring stage")
            done = self.f_end if fwd else self.b_end
            if key not in done:
                raise self._err(rank, act, "sends a tensor this rank has not computed yet")
            return max(self.clock[rank], done[key])
        chan = self.channels.get((act.peer, rank))  # type: ignore[arg-type]
        if not chan:
            return f"waits for a message from rank {act.peer}"
        head, sent = chan[0]
        if head != act:
            raise self._err(
                rank,
                act,
                f"rank {act.peer}'s next message to this rank is for {head}: "
                f"sends and receives between a pair must be in the same order",
            )
        return max(self.clock[rank], sent + self.latency)

    def _apply(self, rank: int, act: Action, start: float) -> None:
        end = start + (0.0 if act.kind.is_comm else self.duration(act))
        if act.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            peer = act.peer
            assert peer is not None
            rv_kind = ActionKind.RECV_F if act.kind is ActionKind.SEND_F else ActionKind.RECV_B
            nb = self.s.next_stage if act.kind is ActionKind.SEND_F else self.s.prev_stage
            rv = Action(rv_kind, nb(act.stage), act.microbatch, peer=rank)  # type: ignore[arg-type]
            self.channels.setdefault((rank, peer), deque()).append((rv, end))
        elif act.kind.is_comm:
            self.channels[(act.peer, rank)].popleft()  # type: ignore[index]
            self.received[(act.kind, act.stage, act.microbatch)] = end
        for part in act.parts:
            key = (part.stage, part.microbatch)
            if part.kind is ActionKind.F:
                self.f_end[key] = end
                self.in_flight[rank] += 1
                self.peak[rank] = max(self.peak[rank], self.in_flight[rank])
            elif part.kind in _BACKWARD:
                self.b_end[key] = end
                self.in_flight[rank] -= 1
                if part.kind is ActionKind.B:
                    self.split_b.add(key)
                    self.w_pending[rank] += 1
                    self.peak_w[rank] = max(self.peak_w[rank], self.w_pending[rank])
            else:  # W
                self.w_pending[rank] -= 1
        self.clock[rank] = end
        self.events[rank].append(Event(rank, act, start, end))

    def run(self, bound: Sequence[int] | None) -> ValidationReport:
        acts = self.s.actions
        progress = True
        while progress:
            progress = False
            for r in range(self.s.pp):
                while self.pc[r] < len(acts[r]):
                    act = acts[r][self.pc[r]]
                    ready = self._ready(r, act)
                    if isinstance(ready, str):
                        break
                    self._apply(r, act, ready)
                    # The peak, not the count after the action: an FB pair's forward is
                    # alive before its backward frees an activation.
                    if bound is not None and self.peak[r] > bound[r]:
                        msg = f"{self.peak[r]} activations in flight, bound is {bound[r]}"
                        raise self._err(r, act, msg)
                    self.pc[r] += 1
                    progress = True
        stuck = [r for r in range(self.s.pp) if self.pc[r] < len(acts[r])]
        if stuck:
            why = "; ".join(
                f"rank {r} at {acts[r][self.pc[r]]} {self._ready(r, acts[r][self.pc[r]])}"
                for r in stuck
            )
            raise ScheduleError(f"{self.s.name}: deadlock: {why}")
        left = [f"{a} from rank {src}" for (src, _), q in self.channels.items() for a, _ in q]
        if left:
            raise ScheduleError(f"{self.s.name}: sends nobody receives: {', '.join(left[:4])}")
        return ValidationReport(
            tuple(self.peak), tuple(self.peak_w), tuple(tuple(e) for e in self.events)
        )


def replay(
    schedule: Schedule,
    duration: Callable[[Action], float] | None = None,
    latency: float = 0.0,
    max_in_flight: int | Sequence[int] | None = None,
) -> ValidationReport:
    """Check coverage, then run the ranks' programs with the given action durations."""
    check_coverage(schedule)
    bound = [max_in_flight] * schedule.pp if isinstance(max_in_flight, int) else max_in_flight
    return _Replay(schedule, duration or (lambda a: 0.0), latency).run(bound)


def validate(
    schedule: Schedule, max_in_flight: int | Sequence[int] | None = None
) -> ValidationReport:
    """Raise `ScheduleError` naming the first problem; else return per-rank peak activations.

    `max_in_flight` bounds the in-flight activations of every rank (an int) or of each rank.
    """
    return replay(schedule, lambda a: 1.0, 0.0, max_in_flight)
