"""Planner output: rich tables, JSON, and three pictures.

`plans_table` (one row per plan), `breakdown_table` (where one plan's step time and memory
go), `write_json`, and the plots `plot_memory` (per pipeline rank against capacity),
`plot_timeline` (the replayed schedule) and `plot_top` (the search's top-k).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.table import Table  # noqa: E402

from hyperloom.pipeline import Costs, StageCost, build_schedule  # noqa: E402
from hyperloom.pipeline import simulate as replay_schedule  # noqa: E402
from hyperloom.pipeline.comm import add_communication  # noqa: E402
from hyperloom.pipeline.plot import plot_timeline as draw_timeline  # noqa: E402
from hyperloom.pipeline.schedules import pair_forward_backward  # noqa: E402
from hyperloom.planner.hardware import GIB  # noqa: E402
from hyperloom.planner.simulate import Plan, prepare  # noqa: E402

MEMORY_PARTS = (
    "params",
    "grads",
    "optimizer",
    "activations",
    "transient",
    "buffers",
    "allocator",  # a CPU allocator's retained pages (0 on devices)
)
_COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B3", "#CCB974", "#64B5CD", "#999999")


def _fmt_time(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.3f} s"


def plans_table(plans: list[Plan], title: str) -> Table:
    t = Table(title=title, title_style="bold")
    cols = [
        "#",
        "tp",
        "pp",
        "v",
        "dp",
        "cp",
        "ep",
        "zero",
        "mbs x m",
        "schedule",
        "recompute",
        "fp8",
        "step",
        "tokens/s",
        "MFU",
        "bubble",
        "peak GiB",
        "reserved GiB",
        "roofline step",
        "roofline MFU",
    ]
    for c in cols:
        t.add_column(c, justify="left" if c in ("schedule", "recompute") else "right")
    for i, p in enumerate(plans, 1):
        s = p.strategy
        t.add_row(
            str(i),
            str(s.tp),
            str(s.pp),
            str(s.stages_per_rank),
            str(s.dp),
            str(s.cp) + (" a2a" if s.cp > 1 and s.cp_comm == "alltoall" else ""),
            str(s.ep) + (" ag" if s.ep > 1 and s.dispatcher == "allgather" else ""),
            str(s.zero),
            f"{s.mbs} x {s.microbatches}",
            s.schedule,
            s.recompute,
            "yes" if s.fp8 else "",
            _fmt_time(p.step_time),
            f"{p.tokens_per_s:,.0f}",
            f"{p.mfu:.1%}",
            f"{p.bubble_fraction:.1%}",
            f"{p.peak_memory / GIB:.1f}",
            f"{p.reserved_memory / GIB:.1f}" + ("" if p.fits else " (!)"),
            _fmt_time(p.roofline_step_time) if p.roofline_step_time else "-",
            f"{p.roofline_mfu:.1%}" if p.roofline_step_time else "-",
        )
    return t


def roofline_note(plan: Plan) -> str:
    """What the step and the roofline columns mean, with this plan's numbers."""
    acc = plan.cluster.profile
    text = (
        f"step and MFU are the realistic prediction ({acc.name}: kernels by shape, links by "
        "tier, every number's source in the profile)"
    )
    if plan.runtime.efficiency != 1.0:
        text += f", scaled by --efficiency {plan.runtime.efficiency:g}"
    if plan.roofline_step_time:
        text += (
            f"; roofline = the bound with every efficiency at 1: "
            f"{_fmt_time(plan.roofline_step_time)}, MFU {plan.roofline_mfu:.1%} "
            f"(the prediction is {plan.step_time / plan.roofline_step_time:.2f}x it)"
        )
    return text


def breakdown_table(plan: Plan) -> tuple[Table, Table]:
    """(time breakdown of the critical rank, memory per rank)."""
    t = Table(
        title=f"step {_fmt_time(plan.step_time)} on the rank that finishes last", title_style="bold"
    )
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    for k, v in plan.breakdown.items():
        if k == "dp_sync_total":
            continue
        t.add_row(k, f"{v:.4f}", f"{v / plan.step_time:.1%}")
    t.add_row("dp sync (total, incl. hidden)", f"{plan.breakdown['dp_sync_total']:.4f}", "")
    m = Table(
        title=f"memory per pipeline rank, GiB (usable {plan.capacity / GIB:.1f})",
        title_style="bold",
        caption="act. peak = the sum of the parts (held at the activation peak: the grads "
        "column is those held then); step peak = params, all grads, optimizer and the "
        "update's copies; peak = the larger",
    )
    cols = (*MEMORY_PARTS, "activation_peak", "step_peak", "peak", "reserved")
    names = {"activation_peak": "act. peak", "step_peak": "step peak"}
    for c in ("rank", *cols):
        m.add_column(names.get(c, c), justify="right")
    for r, mem in enumerate(plan.memory):
        m.add_row(str(r), *(f"{v / GIB:.2f}" for v in memory_row(mem)))
    return t, m


def memory_row(mem) -> list[float]:
    """One rank's memory table row, bytes: the parts at the activation peak (grads: those
    held then), their sum, the step peak (with the allocator's pages), the peak, reserved."""
    parts = [getattr(mem, p) for p in MEMORY_PARTS]
    parts[MEMORY_PARTS.index("grads")] = mem.grads_held
    step = mem.step_peak + mem.allocator
    return [*parts, mem.activation_peak, step, mem.peak, mem.reserved]


def write_json(
    path: str | Path, query: dict[str, Any], plans: list[Plan], search: dict[str, Any] | None = None
) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = {"query": query, "search": search, "plans": [pl.to_dict() for pl in plans]}
    p.write_text(json.dumps(body, indent=2) + "\n")
    return p


def plot_memory(plan: Plan, path: str | Path) -> Path:
    """Stacked memory components per pipeline rank, with the usable capacity as a line."""
    ranks = range(len(plan.memory))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(plan.memory) + 4.5), 4))
    bottom = [0.0] * len(plan.memory)
    for part, color in zip(MEMORY_PARTS, _COLORS, strict=True):
        vals = [getattr(m, part) / GIB for m in plan.memory]
        ax.bar(ranks, vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.axhline(plan.capacity / GIB, color="black", ls="--", lw=1, label="usable capacity")
    ax.set_xticks(list(ranks))
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("GiB")
    ax.set_title(f"{plan.model.name}: {plan.strategy.label()}", fontsize=9, loc="left")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_timeline(plan: Plan, path: str | Path, max_microbatches: int | None = None) -> Path:
    """The plan's schedule replayed with its per-stage costs (seconds), drawn by the pipeline
    plotter; at most `max_microbatches` (default 2*pp, rounded to a valid count)."""
    s = plan.strategy
    m = s.microbatches
    cap = max_microbatches or max(2 * s.pp, 4)
    if m > cap:
        m = cap - cap % s.pp if s.schedule == "interleaved" else cap
        m = m + (m % 2) if s.schedule == "dualpipe" else m
    prep = prepare(plan.model, plan.cluster, s, plan.seq, plan.runtime)
    sched = build_schedule(s.schedule, s.pp, m, s.vpp)
    if s.ep_overlap and prep.fb_overlap != 1.0:  # the pairs the executor overlaps
        sched = pair_forward_backward(sched)
    chunk_of = {st: j for pipe in sched.pipes for j, st in enumerate(pipe.stages)}
    per_stage = {
        st: StageCost(float(prep.f[c]), float(prep.b[c]), float(prep.w[c]))
        for st, c in chunk_of.items()
    }
    if s.pp > 1:
        sched = add_communication(sched)
    costs = Costs(comm=prep.p2p, per_stage=per_stage, fb_overlap=prep.fb_overlap)
    res = replay_schedule(sched, costs)
    note = f" (first {m} of {s.microbatches} micro-batches)" if m < s.microbatches else ""
    title = f"{plan.model.name} {s.label()}: times in s{note}"
    return draw_timeline(res, path, title=title)


def plot_top(plans: list[Plan], path: str | Path) -> Path:
    """Top-k chart: MFU per plan (bars) and reserved memory (dots, right axis)."""
    n = len(plans)
    fig, ax = plt.subplots(figsize=(9, 0.42 * n + 1.6))
    labels = [f"{i + 1}. {p.strategy.label()}" for i, p in enumerate(plans)]
    y = list(range(n))[::-1]
    ax.barh(y, [p.mfu * 100 for p in plans], color="#4C72B0")
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel("MFU, % of BF16 peak", color="#4C72B0")
    ax2 = ax.twiny()
    ax2.plot([p.reserved_memory / GIB for p in plans], y, "o", color="#C44E52")
    ax2.axvline(plans[0].capacity / GIB, color="#C44E52", ls="--", lw=1)
    ax2.set_xlabel("reserved memory, GiB (dashed: usable)", color="#C44E52")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
