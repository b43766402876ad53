"""Insert the point-to-point sends and receives a compute-only schedule needs.

Generators write compute actions only; this pass derives the communication from the stage
graph, so no generator can forget a send or put a receive in the wrong place.

- After each forward of (m, s) whose next stage lives on another rank: ``SEND_F(m, s)``; before
  the consumer's forward of (m, next(s)): ``RECV_F(m, next(s))``.
- After each backward (B, BW or the backward half of FB) of (m, s) whose previous stage lives on
  another rank: ``SEND_B(m, s)``; before the backward of (m, prev(s)): ``RECV_B(m, prev(s))``.
- Stages on the same rank (the turn of a V, or a DualPipe rank's two stages) hand tensors over
  in memory: no comm.

Ordering contract, which `validate` checks: sends are asynchronous (an executor posts
``isend`` and moves on), receives block until their data has arrived, and between any two
ranks the messages from a to b are received in the order a sent them, whatever their kind.
The last point matters for NCCL-style p2p, which matches a pair's sends and receives by issue
order, not by tag: a receiver that posted "gradient 5" while the sender's next message was
"activation 7" would read the wrong tensor.

Placement of receives. Each receive goes as late as possible, i.e. just before the action
that consumes it, unless an earlier consumer on the same channel forces it forward (a receive
cannot pass the one the sender sent after it). Receives therefore only ever sit immediately
before a compute action in a clump; every send the receiver would have issued before that
compute action has been issued, so moving a receive forward this way never creates a wait
cycle that the compute-only order did not have.
"""

from __future__ import annotations

from collections import defaultdict

from hyperloom.pipeline.ir import Action, ActionKind, Schedule, ScheduleError

_BACKWARD = (ActionKind.B, ActionKind.BW)


def _sends_after(sched: Schedule, rank: int, act: Action) -> list[Action]:
    out = []
    for part in act.parts:
        if part.kind is ActionKind.F:
            nxt = sched.next_stage(part.stage)
            if nxt is not None and sched.placement[nxt] != rank:
                peer = sched.placement[nxt]
                out.append(Action(ActionKind.SEND_F, part.stage, part.microbatch, peer=peer))
        elif part.kind in _BACKWARD:
            prv = sched.prev_stage(part.stage)
            if prv is not None and sched.placement[prv] != rank:
                peer = sched.placement[prv]
                out.append(Action(ActionKind.SEND_B, part.stage, part.microbatch, peer=peer))
    return out


def _recvs_needed(sched: Schedule, rank: int, act: Action) -> list[Action]:
    out = []
    for part in act.parts:
        if part.kind is ActionKind.F:
            prv = sched.prev_stage(part.stage)
            if prv is not None and sched.placement[prv] != rank:
                peer = sched.placement[prv]
                out.append(Action(ActionKind.RECV_F, part.stage, part.microbatch, peer=peer))
        elif part.kind in _BACKWARD:
            nxt = sched.next_stage(part.stage)
            if nxt is not None and sched.placement[nxt] != rank:
                peer = sched.placement[nxt]
                out.append(Action(ActionKind.RECV_B, part.stage, part.microbatch, peer=peer))
    return out


def _matching_recv(sched: Schedule, send: Action, dst: int) -> Action:
    """The receive on `dst` that consumes `send`'s tensor."""
    if send.kind is ActionKind.SEND_F:
        s = sched.next_stage(send.stage)
        kind = ActionKind.RECV_F
    else:
        s = sched.prev_stage(send.stage)
        kind = ActionKind.RECV_B
    assert s is not None and sched.placement[s] == dst
    return Action(kind, s, send.microbatch, peer=sched.placement[send.stage])


def add_communication(schedule: Schedule) -> Schedule:
    """Return `schedule` with SEND/RECV actions inserted (see module docstring)."""
    if schedule.has_comm:
        raise ScheduleError(f"{schedule.name}: already has communication actions")
    sched = schedule
    # Each rank's compute list with its sends glued after each action.
    with_sends: list[list[tuple[Action, list[Action]]]] = []
    for r, acts in enumerate(sched.actions):
        with_sends.append([(a, _sends_after(sched, r, a)) for a in acts])

    # Deadline of each receive: the index of its consumer in the receiver's compute list.
    deadline: dict[tuple[int, Action], int] = {}
    for r, acts in enumerate(sched.actions):
        for i, a in enumerate(acts):
            for rv in _recvs_needed(sched, r, a):
                if (r, rv) in deadline:
                    raise ScheduleError(f"{sched.name}: rank {r} consumes {rv} twice")
                deadline[(r, rv)] = i

    # Channel src->dst in the sender's order; walking it backwards, a receive may not sit later
    # than the one after it on the same channel.
    slot: dict[int, dict[int, list[tuple[int, int, Action]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for src, items in enumerate(with_sends):
        channels: dict[int, list[Action]] = defaultdict(list)
        for _, sends in items:
            for snd in sends:
                assert snd.peer is not None
                channels[snd.peer].append(_matching_recv(sched, snd, snd.peer))
        for dst, recvs in channels.items():
            limit = len(sched.actions[dst])
            placed = []
            for rv in reversed(recvs):
                if (dst, rv) not in deadline:
                    raise ScheduleError(
                        f"{sched.name}: rank {src} sends to rank {dst} a tensor no action of "
                        f"rank {dst} consumes ({rv})"
                    )
                limit = min(limit, deadline.pop((dst, rv)))
                placed.append((limit, rv))
            for order, (pos, rv) in enumerate(reversed(placed)):
                slot[dst][pos].append((src, order, rv))
    if deadline:
        (r, rv), _ = next(iter(deadline.items()))
        raise ScheduleError(f"{sched.name}: rank {r} needs {rv} but no rank sends it")

    out: list[list[Action]] = []
    for r, items in enumerate(with_sends):
        acts: list[Action] = []
        for i, (a, sends) in enumerate(items):
            acts += [rv for _, _, rv in sorted(slot[r][i], key=lambda t: (t[0], t[1]))]
            acts.append(a)
            acts += sends
        out.append(acts)
    return sched.with_actions(out)
