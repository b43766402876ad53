"""Registry of schedule generators and `build_schedule`, which checks what each one needs.

Each generator returns a compute-only `Schedule` of (pp, [vpp,] m); `comm.add_communication`
adds the p2p. The published algorithms' constraints, stated once in
`hyperloom.config.schedule_shape_problems`:

==============  =====  ===================================================================
kind            vpp    micro-batches m
==============  =====  ===================================================================
gpipe           1      m >= 1
1f1b            1      m >= 1 (the bubble is (p-1)(F+B+W) for every m)
interleaved     >= 2   m a positive multiple of pp (Megatron's groups of pp micro-batches)
zb-h1           1      m >= 1 (the closed-form bubble needs m >= pp)
zb-v            2      m >= 1, pp >= 2 (V shape: 2 stages per rank, implied)
dualpipe        1      pp even >= 2, m even and >= 2*pp (two model copies, implied)
dualpipev       2      m >= 2*pp (V shape, implied)
==============  =====  ===================================================================
"""

from __future__ import annotations

from collections.abc import Callable

from hyperloom.pipeline.basic import gpipe, interleaved_1f1b, one_f_one_b, require_shape
from hyperloom.pipeline.dualpipe import dualpipe, dualpipev
from hyperloom.pipeline.ir import Action, ActionKind, Pipe, Schedule, ScheduleError
from hyperloom.pipeline.simulate import simulate
from hyperloom.pipeline.zero_bubble import zb_h1, zb_v

# kind -> generator(pp, vpp, m); vpp is passed only where it is a choice.
SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}

DESCRIPTIONS = {
    "gpipe": "all forwards, then all backwards",
    "1f1b": "one forward, one full backward (PipeDream-Flush)",
    "interleaved": "1F1B over vpp chunks per rank (Megatron)",
    "zb-h1": "Zero Bubble H1: split backward, W deferred into the tail",
    "zb-v": "Zero Bubble V: two chunks per rank in a V, split backward",
    "dualpipe": "DualPipe: two model copies, micro-batches from both ends, F&B pairs",
    "dualpipev": "DualPipeV: DualPipe's program on a V of 2*pp stages",
}


def build_schedule(kind: str, pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """Build schedule `kind`; raise `ScheduleError` saying which constraint is broken."""
    require_shape(kind, pp, microbatches, vpp)
    if kind == "interleaved":
        return interleaved_1f1b(pp, vpp, microbatches)
    return SCHEDULES[kind](pp, microbatches)


def pair_forward_backward(schedule: Schedule) -> Schedule:
    """`schedule` (compute-only) with forwards that a rank runs right before a backward of
    another micro-batch merged with it into overlapped FB pairs, which the executor then
    runs as DualPipe runs its pairs (Megatron's "EP A2A overlap" of 1F1B-style steady
    states). A pair waits for both halves' inputs and sends after both end, so a merge can
    delay a neighbour: one is kept only if the schedule, timed with unit costs and no credit
    for the overlap, ends no later than before. That keeps interleaved 1F1B's and ZB-V's
    steady states, where a rank's forward and backward belong to different chunks, and
    leaves plain 1F1B's (each pair would wait for the neighbour's pair before it: Megatron
    asks for virtual stages for the same reason). Schedules that already pair (DualPipe,
    DualPipeV) are returned as they are."""
    if schedule.has_comm:
        raise ScheduleError(f"{schedule.name}: pair before adding communication")
    if any(a.kind is ActionKind.FB for acts in schedule.actions for a in acts):
        return schedule

    def makespan(actions: list[list[Action]]) -> float:
        return simulate(schedule.with_actions(actions)).makespan

    def merged(acts: list[Action], only: int | None = None) -> list[Action]:
        """acts with every candidate pair merged (or only the one at index `only`)."""
        out, i = [], 0
        while i < len(acts):
            a, nxt = acts[i], acts[i + 1] if i + 1 < len(acts) else None
            candidate = (
                nxt is not None
                and a.kind is ActionKind.F
                and nxt.kind in (ActionKind.B, ActionKind.BW)
                and nxt.microbatch != a.microbatch
            )
            if candidate and only in (None, i):
                full = nxt.kind is ActionKind.BW
                out.append(Action.fb((a.stage, a.microbatch), (nxt.stage, nxt.microbatch), full))
                i += 2
            else:
                out.append(a)
                i += 1
        return out

    current = [list(acts) for acts in schedule.actions]
    limit = makespan(current)

    def keeps(rank: int, acts: list[Action]) -> bool:
        try:
            return makespan([*current[:rank], acts, *current[rank + 1 :]]) <= limit
        except ScheduleError:  # the pair would deadlock
            return False

    for rank in range(schedule.pp):
        whole = merged(current[rank])
        if keeps(rank, whole):
            current[rank] = whole
            continue
        i = 0
        while i < len(current[rank]):
            trial = merged(current[rank], only=i)
            if len(trial) < len(current[rank]) and keeps(rank, trial):
                current[rank] = trial
            i += 1
    return schedule.with_actions(current)


def forward_only(schedule: Schedule, microbatches: int) -> Schedule:
    """Forwards of `microbatches` through `schedule`'s first pipe, stage by stage (GPipe's
    forward half): what evaluation runs over the same placement. Compute-only."""
    pipe = schedule.pipes[0]
    n = len(pipe.stages)
    if tuple(pipe.stages) != tuple(range(n)):
        raise ScheduleError(f"{schedule.name}: the first pipe must be stages 0..{n - 1}")
    acts: list[list[Action]] = [[] for _ in range(schedule.pp)]
    for s in pipe.stages:
        for m in range(microbatches):
            acts[schedule.placement[s]].append(Action.f(s, m))
    return Schedule(
        f"{schedule.name}-forward",
        schedule.pp,
        n,
        microbatches,
        schedule.placement[:n],
        (Pipe(pipe.stages, tuple(range(microbatches))),),
        acts,
        schedule.replica_of[:n],
    )
