"""Insert the point-to-point sends and receives a compute-only schedule needs.

Generators write compute actions only; this pass derives communication from the stage graph:
``SEND_F`` after a forward whose next stage is on another rank and ``RECV_F`` before the
consumer's forward, ``SEND_B``/``RECV_B`` likewise for backwards; stages on one rank hand
tensors over in memory.

Contract, checked by `validate`: sends are asynchronous, receives block, and messages from one
rank to another are received in send order whatever their kind (NCCL-style p2p matches by
issue order, not by tag). Each receive goes just before its consumer unless an earlier
consumer on the same channel pulls it forward, so moving receives never creates a wait cycle
the compute-only order did not have.
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
