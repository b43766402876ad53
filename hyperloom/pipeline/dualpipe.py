"""DualPipe and DualPipeV (DeepSeek-V3, arXiv 2412.19437 §3.2.1; deepseek-ai/DualPipe).

DualPipe feeds micro-batches from both ends: pipe 0 runs stages 0..p-1 on ranks 0..p-1, pipe 1
a second copy on ranks p-1..0, half the micro-batches each (`ir.py`). Each rank holds a stage
near the start of one pipe ("phase 0") and one near the end of the other ("phase 1"). The
main step pairs one direction's forward with the other's full backward (an FB action), so on
a GPU one's all-to-all hides behind the other's compute. Weight gradients go to a FIFO queue
(DualPipe's `WeightGradStore`) where B runs alone and are popped where the pipe would idle.

Per rank r, with H = p/2, h = min(r, p-1-r) and C = m/2, the step runs the eight phases of
DualPipe's `step` (counts are loop iterations):

====  ===========  ============  =================================================
 no.  name         iterations    one iteration
====  ===========  ============  =================================================
  1   nF0          2(H-h-1)      F0
  2   nF0F1        h+1           F0, F1
  3   nB1W1F1      H-h-1         B1 (W queued), W (pop), F1
  4   nF0B1F1B0    C-2H+h+1      (F0 + BW1), (F1 + BW0) as FB pairs
  5   nB1F1B0      H-h-1         BW1, (F1 + BW0)
  6   nB1B0        h+1           B1, B0 (full in the first half, W queued in the second)
  7   nWB0         H-h-1         W (pop), B0 (W queued)
  8   nW           h+1           W (pop)
====  ===========  ============  =================================================

F0/B0 act on the phase-0 stage, F1/B1 on the phase-1 stage. On the two middle ranks the first
phase-4 iteration runs F0 then BW1 without overlap, since the backward would wait for the
forward just sent across the middle (as upstream does).

DualPipeV ("cut-in-half"): one pipe of 2p half-sized stages in a V (rank r holds r and
2p-1-r), all micro-batches entering at rank 0; the same program with H -> p, h -> r, C -> m.
DualPipe needs an even p and an even m >= 2p, DualPipeV m >= 2p. The published bubble is
(PP/2 - 1)(F&B + B - 3W), B the full backward, with PP + 1 activations in flight; neither
grows with m.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from hyperloom.pipeline.basic import require_shape
from hyperloom.pipeline.ir import Action, Pipe, Schedule, v_placement


def phase_counts(H: int, h: int, C: int) -> tuple[int, ...]:
    """Published iteration counts of the eight phases (table in the module docstring)."""
    a, b = H - h - 1, h + 1
    return (2 * a, b, a, C - 2 * H + h + 1, a, b, a, b)


def _rank_program(
    H: int, h: int, C: int, stages: tuple[int, int], mbs: tuple[Sequence[int], Sequence[int]]
) -> list[Action]:
    """The eight phases for one rank; `stages`/`mbs` are (phase-0, phase-1) stage and order."""
    f, b = [0, 0], [0, 0]  # next forward / backward index per phase
    w_queue: deque[tuple[int, int]] = deque()  # DualPipe's WeightGradStore: FIFO of (stage, mb)

    def fwd(ph: int) -> tuple[int, int]:
        f[ph] += 1
        return stages[ph], mbs[ph][f[ph] - 1]

    def bwd(ph: int, zb: bool, phase: int) -> Action:
        b[ph] += 1
        s, mb = stages[ph], mbs[ph][b[ph] - 1]
        if zb:  # input gradient now, weight gradient queued
            w_queue.append((s, mb))
            return Action.b(s, mb, phase)
        return Action.bw(s, mb, phase)

    def wgt(phase: int) -> Action:
        return Action.w(*w_queue.popleft(), phase)

    def pair(ph_f: int, ph_b: int, phase: int) -> Action:
        fs = fwd(ph_f)
        b[ph_b] += 1
        return Action.fb(fs, (stages[ph_b], mbs[ph_b][b[ph_b] - 1]), full=True, phase=phase)

    n1, n2, n3, n4, n5, n6, n7, n8 = phase_counts(H, h, C)
    out: list[Action] = []
    out += [Action.f(*fwd(0), 1) for _ in range(n1)]
    for _ in range(n2):
        out += [Action.f(*fwd(0), 2), Action.f(*fwd(1), 2)]
    for _ in range(n3):
        out += [bwd(1, True, 3), wgt(3), Action.f(*fwd(1), 3)]
    for i in range(n4):
        if i == 0 and h == H - 1:  # middle rank: run F0 and BW1 apart (see docstring)
            out += [Action.f(*fwd(0), 4), bwd(1, False, 4)]
        else:
            out.append(pair(0, 1, 4))
        out.append(pair(1, 0, 4))
    for _ in range(n5):
        out += [bwd(1, False, 5), pair(1, 0, 5)]
    zb = False
    for i in range(n6):  # the second half of these backwards defers W (DualPipe's enable_zb)
        if i == n6 // 2 and h % 2 == 1:
            zb = True
        out.append(bwd(1, zb, 6))
        if i == n6 // 2 and h % 2 == 0:
            zb = True
        out.append(bwd(0, zb, 6))
    for _ in range(n7):
        out += [wgt(7), bwd(0, True, 7)]
    out += [wgt(8) for _ in range(n8)]
    assert not w_queue and f == b == [len(mbs[0]), len(mbs[1])], (f, b, len(w_queue))
    return out


def dualpipe(pp: int, m: int) -> Schedule:
    """Bidirectional DualPipe: two model copies, m/2 micro-batches entering from each end."""
    require_shape("dualpipe", pp, m)
    H, C = pp // 2, m // 2
    down, up = tuple(range(C)), tuple(range(C, m))  # pipe 0 and pipe 1 micro-batches
    acts = []
    for r in range(pp):
        h = min(r, pp - 1 - r)
        s_down, s_up = r, 2 * pp - 1 - r  # rank r's stage in pipe 0 and in pipe 1
        if r < H:  # pipe 0 is this rank's upstream direction
            prog = _rank_program(H, h, C, (s_down, s_up), (down, up))
        else:
            prog = _rank_program(H, h, C, (s_up, s_down), (up, down))
        acts.append(prog)
    return Schedule(
        name="dualpipe",
        pp=pp,
        n_stages=2 * pp,
        microbatches=m,
        placement=v_placement(pp),
        pipes=(Pipe(tuple(range(pp)), down), Pipe(tuple(range(pp, 2 * pp)), up)),
        actions=tuple(tuple(a) for a in acts),
        replica_of=tuple(s if s < pp else s - pp for s in range(2 * pp)),
    )


def dualpipev(pp: int, m: int) -> Schedule:
    """DualPipeV: DualPipe's program on a V of 2*pp half-sized stages (one model copy)."""
    require_shape("dualpipev", pp, m)
    order = tuple(range(m))
    acts = [_rank_program(pp, r, m, (r, 2 * pp - 1 - r), (order, order)) for r in range(pp)]
    return Schedule(
        name="dualpipev",
        pp=pp,
        n_stages=2 * pp,
        microbatches=m,
        placement=v_placement(pp),
        pipes=(Pipe(tuple(range(2 * pp)), order),),
        actions=tuple(tuple(a) for a in acts),
    )
