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
from hyperloom.pipeline.ir import Action, Pipe, Schedule, ScheduleError
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
