"""`hyperloom schedule KIND --pp P --microbatches M [--vpp V] [--json FILE] [--png FILE]`.

Builds, validates and simulates a schedule and prints per rank its busy time, bubble, peak
activations and action counts, next to the published closed form; `--json` writes the action
lists with simulated times, `--png` the timeline. `hyperloom.cli` registers it through
`add_schedule_parser`; `ScheduleError` is the user error it reports with exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hyperloom.config.args import number
from hyperloom.pipeline.comm import add_communication
from hyperloom.pipeline.ir import Schedule, dumps_schedule
from hyperloom.pipeline.schedules import DESCRIPTIONS, SCHEDULES, build_schedule
from hyperloom.pipeline.simulate import Costs, SimResult, closed_form_bubble, simulate


def add_schedule_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `schedule` on an argparse sub-parser collection; returns the new parser."""
    kinds = "; ".join(f"{k}: {d}" for k, d in DESCRIPTIONS.items())
    p = subparsers.add_parser(
        "schedule",
        help="build, validate, simulate and draw a pipeline schedule",
        description=f"Pipeline schedules as data. Kinds: {kinds}.",
    )
    p.add_argument("kind", choices=list(SCHEDULES), help="schedule kind")
    p.add_argument("--pp", type=number(int, least=1), required=True, help="pipeline-parallel ranks")
    p.add_argument(
        "--microbatches",
        "-m",
        type=number(int, least=1),
        required=True,
        help="micro-batches per step",
    )
    p.add_argument(
        "--vpp",
        type=int,
        default=1,
        help="model chunks per rank (interleaved only; V-shapes imply 2)",
    )
    p.add_argument("--f", type=number(least=0), default=1.0, help="forward time of a rank's share")
    p.add_argument("--b", type=number(least=0), default=1.0, help="input-gradient backward time")
    p.add_argument("--w", type=number(least=0), default=1.0, help="weight-gradient backward time")
    p.add_argument("--comm", type=number(least=0), default=0.0, help="latency of one p2p transfer")
    p.add_argument(
        "--fb-overlap",
        type=float,
        default=1.0,
        help="an F&B pair takes this times F + its backward (1 = no overlap)",
    )
    p.add_argument("--json", metavar="FILE", help="write the per-rank action lists as JSON")
    p.add_argument(
        "--compute-only", action="store_true", help="leave the send/recv actions out of the JSON"
    )
    p.add_argument("--png", metavar="FILE", help="draw the timeline to this PNG")
    p.add_argument("--actions", action="store_true", help="print each rank's compute actions")
    p.set_defaults(func=cmd_schedule)
    return p


def _console() -> Console:
    probe = Console()
    return probe if probe.is_terminal else Console(width=160)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def rank_table(result: SimResult) -> Table:
    """One row per rank plus a total row."""
    sched = result.schedule
    t = Table(
        title=f"{sched.name}: pp={sched.pp}, stages={sched.n_stages}, "
        f"micro-batches={sched.microbatches}"
    )
    cols = [
        "rank",
        "stages",
        "busy",
        "bubble",
        "bubble %",
        "peak in-flight",
        "act. mem",
        "W pending",
        "F",
        "B",
        "W",
        "BW",
        "F&B",
    ]
    for c in cols:
        t.add_column(c, justify="left" if c == "stages" else "right")
    tot: dict[str, int] = {}
    for r in range(sched.pp):
        n = result.counts(r)
        for k in ("F", "B", "W", "BW", "FB"):
            tot[k] = tot.get(k, 0) + n[k]
        t.add_row(
            str(r),
            ",".join(map(str, sched.stages_of(r))),
            _fmt(result.busy[r]),
            _fmt(result.bubble[r]),
            f"{result.bubble_fraction[r]:.1%}",
            str(result.peak_in_flight[r]),
            _fmt(result.peak_activation_memory[r]),
            str(result.peak_w_pending[r]),
            *(str(n[k]) for k in ("F", "B", "W", "BW", "FB")),
        )
    t.add_section()
    t.add_row(
        "all",
        "",
        _fmt(sum(result.busy)),
        _fmt(sum(result.bubble)),
        f"{result.total_bubble_fraction:.1%}",
        str(max(result.peak_in_flight)),
        _fmt(max(result.peak_activation_memory)),
        str(max(result.peak_w_pending)),
        *(str(tot[k]) for k in ("F", "B", "W", "BW", "FB")),
    )
    return t


def bubble_summary(result: SimResult) -> str:
    """'bubble per rank: simulated 3, closed form (p-1)(F+B+W) = 3 (match)'."""
    lo, hi = min(result.bubble), max(result.bubble)
    sim = _fmt(hi) if abs(hi - lo) < 1e-9 else f"{_fmt(lo)}..{_fmt(hi)}"
    cf = closed_form_bubble(result.schedule, result.costs)
    if cf is None:
        return f"bubble per rank: simulated {sim} (no published closed form for this case)"
    formula, value = cf
    verdict = "match" if abs(hi - value) < 1e-9 and abs(lo - value) < 1e-9 else "differs"
    return f"bubble per rank: simulated {sim}, closed form {formula} = {_fmt(value)} ({verdict})"


def schedule_json(sched: Schedule, result: SimResult) -> dict[str, Any]:
    """The schedule's JSON plus simulated start/end per action and the per-rank figures."""
    d = sched.to_dict()
    for rank, events in zip(d["ranks"], result.events, strict=True):
        for a, e in zip(rank["actions"], events, strict=True):
            a["start"], a["end"] = e.start, e.end
    c = result.costs
    d["simulation"] = {
        "costs": {"f": c.f, "b": c.b, "w": c.w, "comm": c.comm, "fb_overlap": c.fb_overlap},
        "step_time": result.makespan,
        "busy": list(result.busy),
        "bubble": list(result.bubble),
        "bubble_fraction": result.total_bubble_fraction,
        "peak_in_flight": list(result.peak_in_flight),
        "peak_w_pending": list(result.peak_w_pending),
    }
    return d


def cmd_schedule(args: argparse.Namespace) -> int:
    """Run the `schedule` sub-command; raises `ScheduleError` on an invalid combination."""
    sched = build_schedule(args.kind, args.pp, args.microbatches, args.vpp)
    program = add_communication(sched)
    costs = Costs(f=args.f, b=args.b, w=args.w, comm=args.comm, fb_overlap=args.fb_overlap)
    result = simulate(program, costs)  # validates first: raises ScheduleError if broken

    out = _console()
    out.print(rank_table(result))
    out.print(
        f"step time {_fmt(result.makespan)} (work per rank {_fmt(max(result.busy))}), "
        f"bubble {result.total_bubble_fraction:.1%} of all ranks' time"
    )
    out.print(bubble_summary(result), markup=False)
    out.print(
        "peak in-flight: (stage, micro-batch) activations alive at once; act. mem: scaled by "
        "stage size, in micro-batches of a rank's share (1F1B rank 0: pp)",
        style="dim",
    )
    if args.actions:
        out.print(sched.format(), markup=False, highlight=False)
    if args.json:
        shown = program if not args.compute_only else sched
        res = result if not args.compute_only else simulate(sched, costs)
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps_schedule(schedule_json(shown, res)))
        out.print(f"wrote {path}", markup=False)
    if args.png:
        from hyperloom.pipeline.plot import plot_timeline  # matplotlib only when drawing

        out.print(f"wrote {plot_timeline(result, args.png)}", markup=False)
    return 0
