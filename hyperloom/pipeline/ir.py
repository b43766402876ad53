"""Pipeline schedules as data: the intermediate representation every other module shares.

A schedule is, for each pipeline rank, an ordered list of actions. The executor runs it, the
validator replays it symbolically, the simulator times it and the plotter draws it, so a
picture or a predicted step time is a statement about the exact program that runs.

Actions (`ActionKind`): ``F`` forward of micro-batch m through stage s; ``B`` input-gradient
backward and ``W`` weight-gradient backward (Zero Bubble, arXiv 2401.10241 §2), W movable into
bubbles; ``BW`` both in one call; ``FB`` an overlapped pair, one (stage, micro-batch)'s forward
beside another's backward (DualPipe, arXiv 2412.19437 §3.2.1; its backward half is BW by
default, or B); ``SEND_F``/``RECV_F``, ``SEND_B``/``RECV_B`` carry activations forward and input
gradients back, each naming a stage held by the rank that runs it.

``placement[s]`` is the rank holding stage s; micro-batches flow through pipes (chains of
stages ending in a loss):

- standard (GPipe, 1F1B, ZB-H1, interleaved): one pipe, stage s on rank s % pp;
- V-shape (ZB-V, DualPipeV): one pipe of 2pp stages, rank r holds r and 2pp-1-r, so input and
  loss both live on rank 0;
- DualPipe: two pipes over two model copies, pipe 1 entering from rank pp-1 with the second
  half of the micro-batches; ``replica_of[pp+k] = k`` (the copies' gradients are summed).

An action's ``phase`` tag (DualPipe's eight phases) is metadata, not identity.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any


class ScheduleError(ValueError):
    """A schedule cannot be built, is malformed, or would deadlock; the message says why."""


class ActionKind(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    FB = "FB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_comm(self) -> bool:
        return self in _COMM

    @property
    def is_compute(self) -> bool:
        return self not in _COMM


_COMM = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
_COMM_WORDS = {
    ActionKind.SEND_F: "sendF",
    ActionKind.RECV_F: "recvF",
    ActionKind.SEND_B: "sendB",
    ActionKind.RECV_B: "recvB",
}


@dataclass(frozen=True)
class Action:
    """One step of one rank. FB uses ``b_*`` for its backward half; comm actions use ``peer``."""

    kind: ActionKind
    stage: int
    microbatch: int
    b_stage: int | None = None
    b_microbatch: int | None = None
    b_kind: ActionKind | None = None
    peer: int | None = None
    phase: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        kind = ActionKind(self.kind)
        object.__setattr__(self, "kind", kind)
        is_fb = kind is ActionKind.FB
        if is_fb != (self.b_stage is not None and self.b_microbatch is not None):
            raise ScheduleError(f"{kind.value}: b_stage/b_microbatch are set exactly for FB")
        if is_fb:
            b_kind = ActionKind(self.b_kind or ActionKind.BW)
            if b_kind not in (ActionKind.B, ActionKind.BW):
                raise ScheduleError(f"FB's backward half must be B or BW, got {b_kind.value}")
            object.__setattr__(self, "b_kind", b_kind)
        elif self.b_kind is not None:
            raise ScheduleError(f"{kind.value}: b_kind is only for FB")
        if kind.is_comm != (self.peer is not None):
            raise ScheduleError(f"{kind.value}: a peer rank is set exactly for comm actions")

    # Short constructors keep generators readable: `Action.f(s, m)` reads like the papers' F.
    @classmethod
    def f(cls, stage: int, mb: int, phase: int | None = None) -> Action:
        return cls(ActionKind.F, stage, mb, phase=phase)

    @classmethod
    def b(cls, stage: int, mb: int, phase: int | None = None) -> Action:
        return cls(ActionKind.B, stage, mb, phase=phase)

    @classmethod
    def w(cls, stage: int, mb: int, phase: int | None = None) -> Action:
        return cls(ActionKind.W, stage, mb, phase=phase)

    @classmethod
    def bw(cls, stage: int, mb: int, phase: int | None = None) -> Action:
        return cls(ActionKind.BW, stage, mb, phase=phase)

    @classmethod
    def fb(
        cls, f: tuple[int, int], b: tuple[int, int], full: bool = True, phase: int | None = None
    ) -> Action:
        """Overlapped pair: forward of f=(stage, mb) with the backward of b=(stage, mb)."""
        b_kind = ActionKind.BW if full else ActionKind.B
        return cls(ActionKind.FB, f[0], f[1], b[0], b[1], b_kind, phase=phase)

    @property
    def parts(self) -> tuple[Action, ...]:
        """Compute units of this action: an FB pair is its F and its B/BW; comm has none."""
        if self.kind is ActionKind.FB:
            assert self.b_kind is not None and self.b_stage is not None
            assert self.b_microbatch is not None
            back = Action(self.b_kind, self.b_stage, self.b_microbatch, phase=self.phase)
            return (Action.f(self.stage, self.microbatch, self.phase), back)
        return () if self.kind.is_comm else (self,)

    def __str__(self) -> str:
        k = self.kind
        if k is ActionKind.FB:
            assert self.b_kind is not None
            back = f"{self.b_kind.value}{self.b_microbatch}@s{self.b_stage}"
            return f"F{self.microbatch}@s{self.stage}+{back}"
        if k.is_comm:
            arrow = "->" if k in (ActionKind.SEND_F, ActionKind.SEND_B) else "<-"
            return f"{_COMM_WORDS[k]}{self.microbatch}@s{self.stage}{arrow}r{self.peer}"
        return f"{k.value}{self.microbatch}@s{self.stage}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind.value,
            "stage": self.stage,
            "microbatch": self.microbatch,
        }
        if self.kind is ActionKind.FB:
            assert self.b_kind is not None
            d.update(b_kind=self.b_kind.value, b_stage=self.b_stage, b_microbatch=self.b_microbatch)
        if self.peer is not None:
            d["peer"] = self.peer
        if self.phase is not None:
            d["phase"] = self.phase
        d["str"] = str(self)  # for people reading the JSON; ignored on load
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Action:
        b_kind = d.get("b_kind")
        return cls(
            ActionKind(d["kind"]),
            int(d["stage"]),
            int(d["microbatch"]),
            d.get("b_stage"),
            d.get("b_microbatch"),
            ActionKind(b_kind) if b_kind else None,
            d.get("peer"),
            phase=d.get("phase"),
        )


_ACTION_RE = re.compile(
    r"^(?:(?P<comm>send|recv)(?P<ck>[FB])|(?P<k>BW|F|B|W))(?P<m>\d+)@s(?P<s>\d+)"
    r"(?:(?P<arrow>->|<-)r(?P<peer>\d+)|\+(?P<bk>BW|B)(?P<bm>\d+)@s(?P<bs>\d+))?$"
)


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`: 'F3@s1', 'BW0@s2', 'F3@s1+BW0@s6', 'sendF3@s1->r2', ..."""
    mt = _ACTION_RE.match(text.strip())
    if not mt:
        raise ScheduleError(f"cannot parse action {text!r}")
    mb, stage = int(mt["m"]), int(mt["s"])
    if mt["comm"]:
        kind = ActionKind(f"{mt['comm'].upper()}_{mt['ck']}")
        if mt["peer"] is None or (mt["arrow"] == "->") != (mt["comm"] == "send"):
            raise ScheduleError(f"{text!r}: sends need '->rN', receives '<-rN'")
        return Action(kind, stage, mb, peer=int(mt["peer"]))
    if mt["bk"]:
        if mt["k"] != "F":
            raise ScheduleError(f"{text!r}: an overlapped pair is F...+B... or F...+BW...")
        return Action.fb((stage, mb), (int(mt["bs"]), int(mt["bm"])), full=mt["bk"] == "BW")
    if mt["peer"] is not None:
        raise ScheduleError(f"{text!r}: only send/recv name a peer")
    return Action(ActionKind(mt["k"]), stage, mb)


def parse_actions(text: str) -> tuple[Action, ...]:
    """'F0@s0 F1@s0 BW0@s0' -> actions; handy for writing schedules by hand in tests."""
    return tuple(parse_action(t) for t in text.split())


@dataclass(frozen=True)
class Pipe:
    """A chain of stages in forward order and the micro-batches that enter it."""

    stages: tuple[int, ...]
    microbatches: tuple[int, ...]


def standard_placement(pp: int, vpp: int = 1) -> tuple[int, ...]:
    """Stage s on rank s % pp: rank r holds r, r+pp, r+2pp, ... (Megatron's interleaving)."""
    return tuple(s % pp for s in range(pp * vpp))


def v_placement(pp: int) -> tuple[int, ...]:
    """Rank r holds stages r and 2pp-1-r (ZB-V, DualPipeV, and DualPipe's two copies)."""
    return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus the stage graph they run over (see module docstring)."""

    name: str
    pp: int
    n_stages: int
    microbatches: int
    placement: tuple[int, ...]
    pipes: tuple[Pipe, ...]
    actions: tuple[tuple[Action, ...], ...]
    replica_of: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if not self.replica_of:
            object.__setattr__(self, "replica_of", tuple(range(self.n_stages)))
        if len(self.placement) != self.n_stages or len(self.replica_of) != self.n_stages:
            raise ScheduleError(
                f"{self.name}: placement ({len(self.placement)}) and replica_of "
                f"({len(self.replica_of)}) need one entry per stage ({self.n_stages})"
            )
        if len(self.actions) != self.pp or any(not 0 <= r < self.pp for r in self.placement):
            raise ScheduleError(f"{self.name}: need {self.pp} action lists and ranks < pp")
        seen = [s for p in self.pipes for s in p.stages]
        if sorted(seen) != list(range(self.n_stages)):
            raise ScheduleError(f"{self.name}: pipes must cover each stage once, got {seen}")
        mbs = sorted(m for p in self.pipes for m in p.microbatches)
        if mbs != list(range(self.microbatches)):
            raise ScheduleError(f"{self.name}: pipes must take micro-batches 0..m-1 once each")
        # Lookup tables, built once (the dataclass is frozen, so they are set this way).
        nxt: dict[int, int | None] = {}
        prv: dict[int, int | None] = {}
        pipe_of: dict[int, int] = {}
        for i, p in enumerate(self.pipes):
            for j, s in enumerate(p.stages):
                prv[s] = p.stages[j - 1] if j > 0 else None
                nxt[s] = p.stages[j + 1] if j + 1 < len(p.stages) else None
                pipe_of[s] = i
        object.__setattr__(self, "_next", nxt)
        object.__setattr__(self, "_prev", prv)
        object.__setattr__(self, "_pipe_of", pipe_of)

    # ------------------------------------------------------------------ stage graph
    @property
    def vpp(self) -> int:
        """Stages per rank (2 for V-shapes and DualPipe)."""
        return self.n_stages // self.pp

    @property
    def model_chunks_per_rank(self) -> float:
        """Distinct layer chunks per rank: the cost of one stage is (rank share) / this."""
        return len(set(self.replica_of)) / self.pp

    @property
    def loss_stages(self) -> tuple[int, ...]:
        return tuple(p.stages[-1] for p in self.pipes)

    def next_stage(self, s: int) -> int | None:
        return self._next[s]  # type: ignore[attr-defined]

    def prev_stage(self, s: int) -> int | None:
        return self._prev[s]  # type: ignore[attr-defined]

    def pipe_of(self, s: int) -> Pipe:
        return self.pipes[self._pipe_of[s]]  # type: ignore[attr-defined]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.n_stages) if self.placement[s] == rank)

    @property
    def has_comm(self) -> bool:
        return any(a.kind.is_comm for acts in self.actions for a in acts)

    def with_actions(
        self, actions: Sequence[Iterable[Action]], name: str | None = None
    ) -> Schedule:
        return replace(self, actions=tuple(tuple(a) for a in actions), name=name or self.name)

    def compute_only(self) -> Schedule:
        return self.with_actions([[a for a in acts if a.kind.is_compute] for acts in self.actions])

    def format(self) -> str:
        """One line per rank, e.g. 'rank 0: F0@s0 F1@s0 BW0@s0 ...'."""
        return "\n".join(
            f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)
        )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pp": self.pp,
            "vpp": self.vpp,
            "n_stages": self.n_stages,
            "microbatches": self.microbatches,
            "placement": list(self.placement),
            "replica_of": list(self.replica_of),
            "loss_stages": list(self.loss_stages),
            "pipes": [
                {"stages": list(p.stages), "microbatches": list(p.microbatches)} for p in self.pipes
            ],
            "ranks": [
                {"rank": r, "actions": [a.to_dict() for a in acts]}
                for r, acts in enumerate(self.actions)
            ],
        }

    def to_json(self) -> str:
        return dumps_schedule(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        ranks = sorted(d["ranks"], key=lambda x: x["rank"])
        return cls(
            name=d["name"],
            pp=int(d["pp"]),
            n_stages=int(d["n_stages"]),
            microbatches=int(d["microbatches"]),
            placement=tuple(d["placement"]),
            pipes=tuple(Pipe(tuple(p["stages"]), tuple(p["microbatches"])) for p in d["pipes"]),
            actions=tuple(tuple(Action.from_dict(a) for a in r["actions"]) for r in ranks),
            replica_of=tuple(d.get("replica_of") or ()),
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        try:
            return cls.from_dict(json.loads(text))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ScheduleError(f"not a schedule JSON: {exc}") from exc


def dumps_schedule(d: dict[str, Any]) -> str:
    """JSON text of a schedule dict: header fields on one line each, one action per line."""
    items = []
    for key, value in d.items():
        if key != "ranks":
            items.append(f" {json.dumps(key)}: {json.dumps(value)}")
            continue
        ranks = []
        for r in value:
            acts = ",\n   ".join(json.dumps(a) for a in r["actions"])
            ranks.append(f'  {{"rank": {r["rank"]}, "actions": [\n   {acts}\n  ]}}')
        items.append(' "ranks": [\n' + ",\n".join(ranks) + "\n ]")
    return "{\n" + ",\n".join(items) + "\n}\n"
