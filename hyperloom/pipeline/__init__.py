"""Pipeline parallelism: schedules as data.

A schedule is a per-rank list of actions (F, B, W, BW, overlapped FB pairs, sends and
receives) over a stage graph (`ir.py`). Generators (GPipe, 1F1B, interleaved, ZB-H1, ZB-V,
DualPipe, DualPipeV) are plain functions registered in `schedules.SCHEDULES`; `comm` inserts
the p2p actions, `validate` proves a list can run, `simulate` times it, `plot` draws it, and
the executor and the planner consume the same lists.

    >>> from hyperloom.pipeline import build_schedule, simulate
    >>> r = simulate(build_schedule("1f1b", pp=4, microbatches=8))
    >>> r.bubble[0]  # (p - 1)(F + B + W) with F = B = W = 1
    9.0
"""

from hyperloom.pipeline.basic import gpipe, interleaved_1f1b, one_f_one_b
from hyperloom.pipeline.comm import add_communication
from hyperloom.pipeline.dualpipe import dualpipe, dualpipev, phase_counts
from hyperloom.pipeline.ir import (
    Action,
    ActionKind,
    Pipe,
    Schedule,
    ScheduleError,
    parse_action,
    parse_actions,
    standard_placement,
    v_placement,
)
from hyperloom.pipeline.schedules import SCHEDULES, build_schedule
from hyperloom.pipeline.simulate import Costs, SimResult, StageCost, closed_form_bubble, simulate
from hyperloom.pipeline.validate import Event, ValidationReport, validate
from hyperloom.pipeline.zero_bubble import zb_h1, zb_v

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Costs",
    "Event",
    "Pipe",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StageCost",
    "ValidationReport",
    "add_communication",
    "build_schedule",
    "closed_form_bubble",
    "dualpipe",
    "dualpipev",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse_action",
    "parse_actions",
    "phase_counts",
    "simulate",
    "standard_placement",
    "v_placement",
    "validate",
    "zb_h1",
    "zb_v",
]
