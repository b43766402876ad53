"""Run one rank's action list: the single executor behind every schedule.

`PipelineExecutor.run` walks a rank's actions once per step. F feeds token ids (first stage)
or the received or in-memory activation; a pipe's last stage returns the loss, scaled so the
step's gradient is the mean over micro-batches, plus any stage's `side_loss()` (MoE balance
losses). BW/B run autograd from the kept output; B queues linear weight gradients in a
`WeightGradStore`, W runs them. FB runs its forward then its backward, or with `overlap`
both at once as a `parallel.overlap.Duet`: each half's expert-parallel all-to-alls are in
flight while the other half computes (DualPipe's overlapped pair); the numbers are the same. Adjacent receives are batched with
`batch_isend_irecv` and waited for together; sends complete in the background, as `comm.py`'s
contract assumes (waiting on them could deadlock where two ranks send first). Activation shapes
are fixed per job, so receive buffers need no shape exchange.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.parallel.overlap import Duet
from hyperloom.pipeline.ir import Action, ActionKind, Schedule
from hyperloom.pipeline.split_backward import DeferWeightGrads, WeightGradStore


class PipelineExecutor:
    """Executes `schedule`'s actions for pipeline rank `rank` over its stage modules."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        stages: dict[int, nn.Module],
        group,
        act_shape: Sequence[int],
        act_dtype: torch.dtype,
        device: torch.device,
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        overlap: bool = False,
    ) -> None:
        missing = set(schedule.stages_of(rank)) - set(stages)
        if missing:
            raise ValueError(f"rank {rank} runs stages {sorted(missing)} but holds no module")
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.group = group
        self.act_shape, self.act_dtype, self.device = tuple(act_shape), act_dtype, device
        self.forward_context = forward_context
        self.overlap = overlap
        self.trace: list[tuple[Action, Duet]] = []  # the last step's duets, when overlapping
        self.first_stages = {p.stages[0] for p in schedule.pipes}
        self.store = WeightGradStore()
        self.split = any(
            a.kind is ActionKind.B or (a.kind is ActionKind.FB and a.b_kind is ActionKind.B)
            for acts in schedule.actions
            for a in acts
        )

    # ------------------------------------------------------------------ one step

    def run(
        self,
        inputs: Sequence[torch.Tensor],
        labels: Sequence[torch.Tensor],
        loss_scale: float = 1.0,
        train: bool = True,
    ) -> torch.Tensor:
        """Run every action once; returns the sum of this rank's scaled micro-batch losses.

        `inputs[m]`/`labels[m]` are micro-batch m's token ids and targets (only the ranks
        holding first and last stages read them). With `train=False` only forwards run,
        without autograd; the schedule must then hold F actions only.
        """
        if len(inputs) != self.schedule.microbatches or len(labels) != len(inputs):
            raise ValueError(
                f"schedule {self.schedule.name} takes {self.schedule.microbatches} "
                f"micro-batches, got {len(inputs)} inputs and {len(labels)} labels"
            )
        self._inputs, self._labels = inputs, labels
        self._loss_scale, self._train = loss_scale, train
        self._received: dict[tuple[ActionKind, int, int], torch.Tensor] = {}
        self._handoff_act: dict[tuple[int, int], torch.Tensor] = {}
        self._handoff_grad: dict[tuple[int, int], torch.Tensor] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._outbox: dict[tuple[ActionKind, int, int], torch.Tensor] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []
        self._loss = torch.zeros((), device=self.device, dtype=torch.float32)
        self.trace = []
        actions = self.schedule.actions[self.rank]
        with contextlib.nullcontext() if train else torch.no_grad():
            i = 0
            while i < len(actions):
                if actions[i].kind.is_comm:
                    j = i
                    while j < len(actions) and actions[j].kind.is_comm:
                        j += 1
                    self._communicate(actions[i:j])
                    i = j
                else:
                    self._compute(actions[i])
                    i += 1
        for work, _ in self._sends:
            work.wait()
        left = [k for k in self._saved] + self.store.pending()
        if left:
            raise RuntimeError(f"rank {self.rank}: step ended with unconsumed work {left[:4]}")
        self._sends, self._saved = [], {}
        return self._loss

    # ------------------------------------------------------------------ compute

    def _compute(self, act: Action) -> None:
        if self.overlap and self._train and act.kind is ActionKind.FB:
            f, b = act.parts
            duet = Duet((f"F{f.microbatch}@s{f.stage}", f"B{b.microbatch}@s{b.stage}"))
            duet.run(lambda: self._compute(f), lambda: self._compute(b))
            self.trace.append((act, duet))
            return
        for part in act.parts:
            kind = part.kind
            if kind is ActionKind.F:
                self._forward(part.stage, part.microbatch)
            elif kind in (ActionKind.B, ActionKind.BW):
                self._backward(part.stage, part.microbatch, split=kind is ActionKind.B)
            elif kind is ActionKind.W:
                self.store.flush((part.stage, part.microbatch))
            else:  # pragma: no cover - parts() yields compute kinds only
                raise AssertionError(kind)

    def _stage_input(self, s: int, m: int) -> torch.Tensor | None:
        if s in self.first_stages:
            return None
        prev = self.schedule.prev_stage(s)
        assert prev is not None
        if self.schedule.placement[prev] == self.rank:
            x = self._handoff_act.pop((s, m))
        else:
            x = self._received.pop((ActionKind.RECV_F, s, m))
        return x.requires_grad_() if self._train else x

    def _forward(self, s: int, m: int) -> None:
        x = self._stage_input(s, m)
        feed = self._inputs[m] if x is None else x
        mode = DeferWeightGrads(self.store) if self.split and self._train else None
        nxt = self.schedule.next_stage(s)
        labels = self._labels[m] if nxt is None else None
        with self.forward_context(), mode or contextlib.nullcontext():
            out = self.stages[s](feed, labels=labels)
            side = _side_loss(self.stages[s]) if nxt is not None else None
        if side is not None:  # e.g. MoE balance losses of a stage before the last
            side = side * self._loss_scale
            self._loss += side.detach().float()
        if nxt is None:  # the pipe's last stage: out is the micro-batch's mean loss
            out = out * self._loss_scale
            self._loss += out.detach().float()
        elif self.schedule.placement[nxt] == self.rank:
            self._handoff_act[(nxt, m)] = out.detach()
        else:
            self._outbox[(ActionKind.SEND_F, s, m)] = out.detach().to(self.act_dtype)
        if self._train:
            self._saved[(s, m)] = (x, out, side)

    def _backward(self, s: int, m: int, split: bool) -> None:
        x, out, side = self._saved.pop((s, m))
        nxt = self.schedule.next_stage(s)
        if nxt is None:
            grad = None  # out is the loss
        elif self.schedule.placement[nxt] == self.rank:
            grad = self._handoff_grad.pop((s, m))
        else:
            grad = self._received.pop((ActionKind.RECV_B, s, m))
        collect = self.store.collect((s, m)) if split else contextlib.nullcontext()
        with collect:
            if side is None:
                torch.autograd.backward(out, None if grad is None else grad.to(out.dtype))
            else:  # the stage's own loss term joins the gradient arriving from downstream
                torch.autograd.backward([out, side], [grad.to(out.dtype), None])
        if x is None:
            return  # a first stage: token ids have no gradient
        prev = self.schedule.prev_stage(s)
        assert prev is not None and x.grad is not None
        if self.schedule.placement[prev] == self.rank:
            self._handoff_grad[(prev, m)] = x.grad
        else:
            self._outbox[(ActionKind.SEND_B, s, m)] = x.grad.to(self.act_dtype)

    # ------------------------------------------------------------------ communication

    def _peer(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer)

    def _communicate(self, acts: Sequence[Action]) -> None:
        sends, recvs, bufs = [], [], []
        for a in acts:
            key = (a.kind, a.stage, a.microbatch)
            assert a.peer is not None
            if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                t = self._outbox.pop(key).contiguous()
                sends.append(dist.P2POp(dist.isend, t, self._peer(a.peer), self.group))
                bufs.append(t)
            else:
                t = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                recvs.append(dist.P2POp(dist.irecv, t, self._peer(a.peer), self.group))
                self._received[key] = t
        if sends:
            for work in dist.batch_isend_irecv(sends):
                self._sends.append((work, bufs))
        if recvs:
            for work in dist.batch_isend_irecv(recvs):
                work.wait()


def _side_loss(stage: torch.nn.Module) -> torch.Tensor | None:
    """A loss term the stage's forward computed besides its output (MoE auxiliary balance
    losses on a stage before the last: `side_loss()`), or None."""
    side_loss = getattr(stage, "side_loss", None)
    return side_loss() if side_loss is not None else None
