"""Computation-communication overlap of two micro-batches: a `Duet` runs one micro-batch's
forward beside another's backward, handing the compute to the other whenever one of them
starts a collective, so each one's all-to-all is in flight while the other computes.

This is DeepSeek-V3's overlapped forward-and-backward chunk pair (arXiv 2412.19437 §3.2.1)
and Megatron-Core's "EP A2A overlap" for 1F1B steady states. Both split each layer by hand
into attention, dispatch, MLP and combine parts and issue the communication on another CUDA
stream. Here the split falls where the communication is: the two halves run as two threads
holding one baton, and a collective, started asynchronously (`async_op=True`, which gloo on
CPU and NCCL on GPU both support), passes the baton before it is waited for
(`wait_overlapped`). Only the baton holder computes, in the order the code is written, so
each micro-batch runs exactly the operations it runs alone: the numbers are those of the
sequential pair, and the switch points are the same on every rank of a group, so
collectives meet in the same order everywhere. The backward's collectives, inside autograd,
switch the same way, whichever thread autograd runs them on. Collectives a lane runs
synchronously (the tensor- and expert-tensor-parallel all-reduces, the count exchange) are
no switch points and need none: the holder blocks until the group's other ranks, which run
the same lanes switching at the same points, reach the same call.

Duets run the pipeline executor's FB actions and, without a pipeline, gradient
accumulation's micro-batch i forward beside i-1's backward (`overlap_accum`).

Lanes start from the caller's context variables (FP8 autocast and friends) and grad mode;
torch's thread-local modes entered inside a lane stay in it. The two lane threads live for
the whole process (`_Worker`), one pair after another.

`CommStats` keeps, for the collectives waited through `wait_overlapped`, the time each was
in flight and the part of it a lane sat waiting (exposed); `Duet.trace` records who held the
baton when, for a timeline of one step.
"""

from __future__ import annotations

import contextvars
import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_active: Duet | None = None  # the duet running now (one per process at a time)


@dataclass
class CommStats:
    """Collectives waited through `wait_overlapped` since the last `reset`."""

    count: int = 0
    in_flight_s: float = 0.0  # start to completion, summed
    exposed_s: float = 0.0  # time a lane sat waiting for completion, summed
    hidden_by_duet: int = 0  # collectives during which the other lane computed
    paired_in_flight_s: float = 0.0  # the same two sums over collectives inside a duet
    paired_exposed_s: float = 0.0

    def reset(self) -> None:
        self.count, self.in_flight_s, self.exposed_s, self.hidden_by_duet = 0, 0.0, 0.0, 0
        self.paired_in_flight_s = self.paired_exposed_s = 0.0


STATS = CommStats()


@dataclass
class Span:
    """One interval of a duet's timeline (seconds from the duet's start)."""

    lane: int  # 0 = the first callable (the forward), 1 = the second (the backward)
    kind: str  # "compute"; a collective's label (in flight); "<label>:wait" (exposed)
    start: float
    end: float


@dataclass
class Duet:
    """Two callables run as alternating lanes (module docstring). `labels` name the lanes
    in the trace."""

    labels: tuple[str, str] = ("F", "B")
    trace: list[Span] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._holder = 0
        self._done = [False, False]
        self._errors: list[BaseException] = []
        self._t0 = 0.0
        self._since = 0.0  # when the holder last took the baton

    def run(self, first: Callable[[], None], second: Callable[[], None]) -> None:
        """Run `first` and `second` to completion, `first` starting; re-raise the first
        error either raised."""
        global _active
        if _active is not None:
            raise RuntimeError("a Duet is already running; duets do not nest")
        grad = torch.is_grad_enabled()
        self._t0, self._since = time.perf_counter(), 0.0
        _active = self
        try:
            for i, fn in enumerate((first, second)):
                job = functools.partial(self._lane, i, fn, contextvars.copy_context(), grad)
                _worker(i).submit(job)
            with self._cond:
                self._cond.wait_for(lambda: all(self._done))
        finally:
            _active = None
        if self._errors:
            raise self._errors[0]

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _lane(self, i: int, fn, ctx: contextvars.Context, grad: bool) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._holder == i)
        try:
            with torch.set_grad_enabled(grad):
                ctx.run(fn)
        except BaseException as e:  # handed to run(), which re-raises it
            self._errors.append(e)
        finally:
            with self._cond:
                self._close_span(i)
                self._done[i] = True
                self._holder = 1 - i
                self._cond.notify_all()

    def _close_span(self, lane: int) -> None:
        now = self._now()
        if now > self._since:
            self.trace.append(Span(lane, "compute", self._since, now))
        self._since = now

    def record(self, label: str, start: float, waiting: float, end: float) -> None:
        """The holder's collective `label` (perf_counter times): in flight from `start`,
        waited for from `waiting` (exposed) to `end`; its compute resumes now."""
        lane, t0 = self._holder, self._t0
        self.trace.append(Span(lane, label, start - t0, end - t0))
        self.trace.append(Span(lane, f"{label}:wait", waiting - t0, end - t0))
        self._since = self._now()

    def hand_over(self) -> bool:
        """Called by the baton holder after starting a collective: let the other lane
        compute until it starts one of its own or ends, then take the baton back. False
        when the other lane has ended (nothing to overlap with)."""
        with self._cond:
            me = self._holder
            other = 1 - me
            self._close_span(me)  # the holder computed up to here
            if self._done[other]:
                return False
            self._holder = other
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._holder == me)
            self._since = self._now()
            return True


class _Worker:
    """A lane's thread, kept for the whole process: a new thread per pair would start each
    lane on fresh thread-local state (an allocator arena whose pages the OS must fault in
    and zero again) every time. Runs one job at a time; jobs restore the thread-local
    torch state they set (grad mode, autocast, modes) before they end."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            self._jobs.get()()  # a job never raises: `Duet._lane` keeps its errors


_workers: list[_Worker] = []
_workers_lock = threading.Lock()


def _worker(i: int) -> _Worker:
    """Lane i's thread (started on first use)."""
    with _workers_lock:
        while len(_workers) <= i:
            _workers.append(_Worker(f"duet-lane-{len(_workers)}"))
        return _workers[i]


def wait_overlapped(work, label: str = "comm") -> None:
    """Wait for an async collective's `work`, first handing the compute to the other lane
    of a running `Duet`, if any; counts the wait in `STATS` (and the trace)."""
    start = time.perf_counter()
    duet = _active
    handed = duet.hand_over() if duet is not None else False
    waiting = time.perf_counter()
    work.wait()
    end = time.perf_counter()
    STATS.count += 1
    STATS.in_flight_s += end - start
    STATS.exposed_s += end - waiting
    STATS.hidden_by_duet += handed
    if duet is not None:
        STATS.paired_in_flight_s += end - start
        STATS.paired_exposed_s += end - waiting
        duet.record(label, start, waiting, end)


def running() -> bool:
    """Whether a `Duet` is running (collectives started now may overlap the other lane)."""
    return _active is not None
