"""GPipe, 1F1B and interleaved 1F1B: the schedules with a full backward (BW) per stage.

- GPipe (arXiv 1811.06965): every forward, then every backward; bubble (p - 1)(F + B + W) per
  rank, all m activations alive at the turn.
- 1F1B, "PipeDream-Flush" (arXiv 2104.04473 §2.2.1): rank r runs p - r - 1 warm-up
  forwards, then alternates forward and backward, then drains. Same bubble, but at most
  p - r activations, independent of m.
- Interleaved 1F1B (same paper §2.2.2): v chunks per rank (stage s on rank s % p), bubble
  (p - 1)(F + B + W) / v for v times the p2p traffic. We follow Megatron-LM's ordering
  (`forward_backward_pipelining_with_interleaving`): micro-batches in groups of p, each
  group running every chunk's forwards in chunk order, backwards in reverse; rank r warms up
  with 2(p - r - 1) + (v - 1)p forwards. Groups are exactly p micro-batches because the
  first group's chunk-c forwards reach rank p - 1 just as rank 0 needs them for chunk c + 1.

Which (pp, m) each generator accepts is one rule, `hyperloom.config.schedule_shape_problems`,
which `require_shape` raises here.
"""

from __future__ import annotations

from hyperloom.config import schedule_shape_problems
from hyperloom.pipeline.ir import Action, Pipe, Schedule, ScheduleError, standard_placement


def _standard(name: str, pp: int, vpp: int, m: int, actions: list[list[Action]]) -> Schedule:
    n = pp * vpp
    return Schedule(
        name=name,
        pp=pp,
        n_stages=n,
        microbatches=m,
        placement=standard_placement(pp, vpp),
        pipes=(Pipe(tuple(range(n)), tuple(range(m))),),
        actions=tuple(tuple(a) for a in actions),
    )


def require_shape(kind: str, pp: int, m: int, vpp: int = 1) -> None:
    """Raise `ScheduleError` saying which precondition of schedule `kind` pp ranks, m
    micro-batches and vpp chunks per rank break (`hyperloom.config.schedule_shape_problems`)."""
    problems = schedule_shape_problems(kind, pp, m, vpp)
    if problems:
        raise ScheduleError(problems[0])


def gpipe(pp: int, m: int) -> Schedule:
    """All forwards, then all full backwards (in micro-batch order, as torch.pipelining)."""
    require_shape("gpipe", pp, m)
    acts = [
        [Action.f(r, i) for i in range(m)] + [Action.bw(r, i) for i in range(m)] for r in range(pp)
    ]
    return _standard("gpipe", pp, 1, m, acts)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """Warm-up forwards, one-forward-one-backward, drain (PipeDream-Flush)."""
    require_shape("1f1b", pp, m)
    acts = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        seq = [Action.f(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            seq += [Action.f(r, warmup + i), Action.bw(r, i)]
        seq += [Action.bw(r, i) for i in range(m - warmup, m)]
        acts.append(seq)
    return _standard("1f1b", pp, 1, m, acts)


def interleaved_order(pp: int, vpp: int, m: int) -> list[tuple[int, int]]:
    """Megatron's table of (micro-batch, chunk) in forward order; groups of pp micro-batches."""
    table = []
    for first in range(0, m, pp):
        group = range(first, min(first + pp, m))
        table += [(mb, c) for c in range(vpp) for mb in group]
    return table


def interleaved_1f1b(pp: int, vpp: int, m: int) -> Schedule:
    """Interleaved 1F1B with `vpp` chunks per rank (Megatron ordering, see module docstring)."""
    require_shape("interleaved", pp, m, vpp)
    table = interleaved_order(pp, vpp, m)
    total = len(table)  # m * vpp forwards per rank
    acts = []
    for r in range(pp):
        fwd = [Action.f(c * pp + r, mb) for mb, c in table]
        bwd = [Action.bw((vpp - 1 - c) * pp + r, mb) for mb, c in table]
        warmup = min(2 * (pp - r - 1) + (vpp - 1) * pp, total)
        seq = fwd[:warmup]
        for i in range(total - warmup):
            seq += [fwd[warmup + i], bwd[i]]
        seq += bwd[total - warmup :]
        acts.append(seq)
    return _standard("interleaved", pp, vpp, m, acts)
