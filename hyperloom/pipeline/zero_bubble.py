"""Zero Bubble schedules: ZB-H1 and ZB-V (Qi et al., arXiv 2401.10241; sail-sg/zero-bubble).

Splitting a backward into B (which the previous stage waits for) and W (which nobody needs)
keeps only B on the critical path; W fills the bubbles.

ZB-H1 (§3.1) keeps 1F1B's warm-up and memory and alternates F and B; rank r defers its W's by
r steps (W of micro-batch k - r after B of k) and flushes the last r + 1 at the end, filling
the tail where it would wait for the last backwards. The bubble becomes (p - 1)(F + B - W)
(m >= p, W <= F, B) against 1F1B's (p - 1)(F + B + W); deferred W's hold only their inputs
(`peak_w_pending`, r + 1 on rank r).

ZB-V (§6; torch.distributed.pipelining's `ScheduleZBVZeroBubble`): 2p half-sized chunks in a
V (rank r holds r and 2p-1-r), input and loss on rank 0. Warm-up of 2(p - r) - 1 first-leg
forwards, r pairs (second-leg F, first-leg F), p - r rounds of second-leg F, B, W; then
(F, B, W) alternating on both legs; then B's and W's drain. Peak memory equals 1F1B's and,
with F = B = W, the bubble is a small constant independent of m. Both return compute-only
schedules.
"""

from __future__ import annotations

from hyperloom.pipeline.basic import _standard, require_shape
from hyperloom.pipeline.ir import Action, Pipe, Schedule, v_placement


def zb_h1(pp: int, m: int) -> Schedule:
    """1F1B with split backward and rank r's weight gradients deferred by r steps."""
    require_shape("zb-h1", pp, m)
    acts = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        seq = [Action.f(r, i) for i in range(warmup)]
        w_next = 0  # W is a FIFO: the oldest B's weight gradient runs first
        for k in range(m):
            if warmup + k < m:
                seq.append(Action.f(r, warmup + k))
            seq.append(Action.b(r, k))
            if k >= r:  # deferral of r steps: these W's fill the tail bubble
                seq.append(Action.w(r, w_next))
                w_next += 1
        seq += [Action.w(r, i) for i in range(w_next, m)]
        acts.append(seq)
    return _standard("zb-h1", pp, 1, m, acts)


def zb_v(pp: int, m: int) -> Schedule:
    """ZB-V: two chunks per rank in a V, split backward (see module docstring)."""
    require_shape("zb-v", pp, m)
    # The steady-state recipe assumes at least 2p - 1 micro-batches to fill the V; fewer are
    # scheduled as if there were that many, then the absent micro-batches are dropped (the
    # order of the rest stays valid because dropping work only removes dependencies).
    n = max(2 * pp - 1, m)
    acts = []
    for r in range(pp):
        s0, s1 = r, 2 * pp - 1 - r  # first and second leg of the V
        f0 = f1 = b0 = b1 = 0
        seq: list[Action] = []
        for _ in range(2 * (pp - r) - 1):  # warm-up: fill the first leg
            seq.append(Action.f(s0, f0))
            f0 += 1
        for _ in range(r):  # the turn of the V reaches this rank: alternate legs
            seq += [Action.f(s1, f1), Action.f(s0, f0)]
            f1, f0 = f1 + 1, f0 + 1
        for _ in range(pp - r):  # first backwards on the second leg, W right away
            seq += [Action.f(s1, f1), Action.b(s1, b1), Action.w(s1, b1)]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < n:  # steady state: F B W on each leg in turn
            if f0 < n:
                seq.append(Action.f(s0, f0))
                f0 += 1
            seq += [Action.b(s0, b0), Action.w(s0, b0)]
            b0 += 1
            seq += [Action.f(s1, f1), Action.b(s1, b1), Action.w(s1, b1)]
            f1, b1 = f1 + 1, b1 + 1
        w0, w1 = b0, b1
        for _ in range(r):  # cool-down: B's first (others wait for them), W's after
            seq += [Action.b(s0, b0), Action.b(s1, b1)]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(pp - r):
            seq += [Action.b(s0, b0), Action.w(s0, w0)]
            b0, w0 = b0 + 1, w0 + 1
        seq += [Action.w(s1, i) for i in range(w1, b1)]
        seq += [Action.w(s0, i) for i in range(w0, b0)]
        acts.append([a for a in seq if a.microbatch < m])
    return Schedule(
        name="zb-v",
        pp=pp,
        n_stages=2 * pp,
        microbatches=m,
        placement=v_placement(pp),
        pipes=(Pipe(tuple(range(2 * pp)), tuple(range(m))),),
        actions=tuple(tuple(a) for a in acts),
    )
