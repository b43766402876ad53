"""Timeline picture of a simulated schedule: ranks down, time across, one box per action.

Colour is the action (F blue, B green, W grey, an FB pair in two lanes), shade the chunk (a
rank's second chunk darker, so V shapes and DualPipe's directions stand out), the number the
micro-batch; white space is bubble. Matplotlib runs headless (Agg).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.legend_handler import HandlerBase  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from hyperloom.pipeline.ir import ActionKind, Schedule  # noqa: E402
from hyperloom.pipeline.simulate import SimResult  # noqa: E402

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#A0A0A0", "comm": "#E08E2B"}


class _BWKey:
    """Legend entry for a full backward: drawn like the boxes, green with a grey foot."""

    def get_label(self) -> str:
        return "BW full backward (grey foot: W share)"


class _BWKeyDrawer(HandlerBase):
    def create_artists(self, legend, orig_handle, xd, yd, width, height, fontsize, trans):
        body = Rectangle((xd, yd), width, height, facecolor=COLORS["B"], transform=trans)
        foot = Rectangle(
            (xd + width / 2, yd), width / 2, height * 0.3, facecolor=COLORS["W"], transform=trans
        )
        return [body, foot]


def _shade(color: str, chunk: int, n_chunks: int) -> tuple[float, float, float]:
    """Chunk 0 light, the last chunk dark: mixes toward white or black by the chunk index."""
    r, g, b = to_rgb(color)
    if n_chunks <= 1:
        return r, g, b
    t = chunk / (n_chunks - 1)  # 0 .. 1
    mix = 0.35 - 0.65 * t  # +0.35 (toward white) .. -0.30 (toward black)
    if mix >= 0:
        return r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix
    return r * (1 + mix), g * (1 + mix), b * (1 + mix)


def _chunk_of(sched: Schedule, stage: int) -> int:
    """Index of `stage` among the stages its rank holds (0 = first chunk)."""
    return sched.stages_of(sched.placement[stage]).index(stage)


def _text_color(rgb: tuple[float, float, float]) -> str:
    return "white" if 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 0.55 else "black"


def plot_timeline(result: SimResult, path: str | Path, title: str | None = None) -> Path:
    """Draw `result` (from `simulate`) as a PNG at `path`; returns the path."""
    sched, costs = result.schedule, result.costs
    pp, span = sched.pp, result.makespan or 1.0
    n_chunks = sched.vpp
    durations = [e.end - e.start for evs in result.events for e in evs if e.end > e.start]
    unit = min(durations, default=1.0)
    # ~0.26 inch per shortest action keeps two-digit labels readable; bounded both ways.
    width = min(34.0, max(11.0, 0.26 * span / unit + 2.5))
    fig, ax = plt.subplots(figsize=(width, 1.35 + 0.62 * pp))
    fontsize = 7.5 if pp <= 8 else 6.5
    min_label = unit * 0.7  # boxes narrower than this stay unlabelled

    def box(x: float, w: float, y: float, h: float, rgb, label: str | None, lw: float = 0.0):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=rgb, edgecolor="white", linewidth=lw))
        if label is not None and w >= min_label:
            ax.text(
                x + w / 2,
                y + h / 2,
                label,
                ha="center",
                va="center",
                fontsize=fontsize if h > 0.5 else fontsize - 1,
                color=_text_color(rgb),
            )

    for rank, events in enumerate(result.events):
        y0 = pp - 1 - rank  # rank 0 on top
        for e in events:
            a, x, w = e.action, e.start, e.end - e.start
            if a.kind.is_comm:
                if w > 0:  # a receive waiting for its data
                    ax.add_patch(Rectangle((x, y0 - 0.02), w, 0.1, facecolor=COLORS["comm"]))
                continue
            if a.kind is ActionKind.FB:
                fpart, bpart = a.parts
                fc = _shade(COLORS["F"], _chunk_of(sched, fpart.stage), n_chunks)
                bc = _shade(COLORS["B"], _chunk_of(sched, bpart.stage), n_chunks)
                box(x, w, y0 + 0.45, 0.4, fc, str(fpart.microbatch))
                box(x, w, y0 + 0.05, 0.4, bc, str(bpart.microbatch))
                ax.add_patch(
                    Rectangle((x, y0 + 0.05), w, 0.8, fill=False, edgecolor="black", linewidth=0.6)
                )
                continue
            chunk = _chunk_of(sched, a.stage)
            if a.kind is ActionKind.BW:
                # One box (it is one call), green like B, with its W share as a grey foot.
                c = costs.stage(sched, a.stage)
                wb = w * c.b / (c.b + c.w) if c.b + c.w > 0 else w
                bc = _shade(COLORS["B"], chunk, n_chunks)
                box(x, w, y0 + 0.05, 0.8, bc, None, lw=0.8)
                ax.add_patch(
                    Rectangle(
                        (x + wb, y0 + 0.05),
                        w - wb,
                        0.22,
                        facecolor=_shade(COLORS["W"], chunk, n_chunks),
                    )
                )
                ax.text(
                    x + w / 2,
                    y0 + 0.52,
                    str(a.microbatch),
                    ha="center",
                    va="center",
                    fontsize=fontsize,
                    color=_text_color(bc),
                )
                continue
            rgb = _shade(COLORS[a.kind.value], chunk, n_chunks)
            box(x, w, y0 + 0.05, 0.8, rgb, str(a.microbatch), lw=0.8)
        ax.text(
            span * 1.005,
            y0 + 0.45,
            f"idle {result.bubble_fraction[rank]:.0%}",
            va="center",
            ha="left",
            fontsize=fontsize + 0.5,
            color="#444444",
        )

    ax.set_xlim(0, span * 1.06)
    ax.set_ylim(-0.15, pp + 0.05)
    ax.set_yticks([pp - 1 - r + 0.45 for r in range(pp)], [f"rank {r}" for r in range(pp)])
    ax.set_xlabel("time (cost units)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="#EEEEEE", linewidth=0.6)
    ax.set_axisbelow(True)

    handles = [
        Patch(facecolor=COLORS["F"], label="F forward"),
        Patch(facecolor=COLORS["B"], label="B input grad"),
        Patch(facecolor=COLORS["W"], label="W weight grad"),
    ]
    kinds = {e.action.kind for evs in result.events for e in evs}
    if ActionKind.BW in kinds:
        handles.append(_BWKey())
    if ActionKind.FB in kinds:
        handles.append(
            Patch(facecolor="white", edgecolor="black", label="F&B pair: F top, B bottom")
        )
    if n_chunks > 1:
        what = "reverse direction" if sched.name == "dualpipe" else "later chunk"
        handles.append(
            Patch(facecolor=_shade(COLORS["F"], n_chunks - 1, n_chunks), label=f"darker = {what}")
        )
    # Legend under the axis, wrapped to the figure's width; the layout leaves room for it.
    ncol = max(1, min(len(handles), int(width / 2.7)))
    rows = -(-len(handles) // ncol)
    fig.legend(
        handles,
        [h.get_label() for h in handles],
        loc="lower center",
        ncol=ncol,
        fontsize=8,
        frameon=False,
        handlelength=1.6,
        bbox_to_anchor=(0.5, 0.0),
        handler_map={_BWKey: _BWKeyDrawer()},
    )
    shape = {"zb-v": " (V)", "dualpipev": " (V)", "dualpipe": " (2 directions)"}
    vpp = shape.get(sched.name, f" vpp={sched.vpp}" if sched.vpp > 1 else "")
    head = title or (
        f"{sched.name}  pp={pp}{vpp} m={sched.microbatches}   step {result.makespan:g}, "
        f"bubble {result.total_bubble_fraction:.1%}   "
        f"(F={costs.f:g} B={costs.b:g} W={costs.w:g} per rank share)"
    )
    ax.set_title(head, fontsize=10, loc="left")
    fig.tight_layout(rect=(0, (0.12 + 0.22 * rows) / fig.get_figheight(), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
