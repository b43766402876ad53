"""ZeRO-1 distributed optimizer: FP32 master weights and AdamW state sharded over dp.

With Adam, 12 of the 16 bytes per parameter of mixed-precision training are optimizer state
that every data-parallel rank updates identically (ZeRO, arXiv 1910.02054). Stage 1 gives each
rank 1/dp of it: gradients are reduce-scattered, each rank runs AdamW on its slice of the
master weights, and the slices are all-gathered back, the same traffic as DDP's all-reduce.

As in Megatron's distributed optimizer, this rank's parameters lie end to end in one flat FP32
space padded to a multiple of dp, and rank r owns a contiguous range that may cut a tensor in
two; the range is kept as pieces of parameters, so weight decay and norm bookkeeping are
per-piece flags and setup allocates nothing of full size. Gradients accumulate locally and
are reduced once per step (not yet overlapped with backward). When every parameter is FP32,
each `p.grad` is a view of one flat buffer that is also the collectives' input and output. On
gloo, whose reduce-scatter and all-gather allocate a whole-buffer temporary and measured
slower, gradients and weights go through in-place all-reduces instead (docs/parallelism.md).
The update is `torch.optim.AdamW`'s element for element, so zero = 1 equals one process to
rounding.

Expert parallelism: the routed experts differ between the ep ranks, so they get a flat space
of their own, sharded over their expert-data-parallel group (the ranks holding the same
experts), whose gradient is summed there and divided by dp (as `ExpertParallelism.reduce_grads`
makes it); the dense parameters are sharded over dp as before. The master weights and moments
hold both shards side by side.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.accelerator import sum_of_squares
from hyperloom.config import TrainConfig
from hyperloom.models.shard import shard_of

if TYPE_CHECKING:
    from hyperloom.parallel.expert_parallel import ExpertParallelism


@dataclass(frozen=True)
class _Space:
    """A run of parameters flattened end to end, padded to a multiple of `size`, sharded
    over `group`: elements [offset, offset + padded) of the flat buffer, this rank's shard
    [lo, hi) of them and [start, start + shard) of the master weights and moments."""

    group: object | None  # None: one rank, no collective
    size: int
    rank: int
    divide: int  # the reduced gradient: the sum over `group` divided by this
    first: int  # parameters [first, last) of the optimizer's list
    last: int
    numel: int
    offset: int
    start: int

    @property
    def padded(self) -> int:
        return math.ceil(self.numel / self.size) * self.size

    @property
    def shard(self) -> int:
        return self.padded // self.size

    @property
    def lo(self) -> int:
        return self.rank * self.shard

    @property
    def hi(self) -> int:
        return self.lo + self.shard


@dataclass(frozen=True)
class _Piece:
    """The part of one parameter inside this rank's owned range: elements [p0, p1) of the
    flattened parameter are elements [s0, s1) of the shard."""

    index: int
    p0: int
    p1: int
    s0: int
    s1: int


class ZeroOneAdamW:
    """AdamW over this rank's 1/dp of the flattened parameters (see module docstring).

    Offers the slice of the `torch.optim.Optimizer` interface the trainer uses:
    `param_groups` (for the learning rate), `step()`, `zero_grad()`.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        dp_group,
        tp_group=None,
        counted: Callable[[nn.Parameter], bool] | None = None,
        extra_norm_group=None,
        in_place: bool | None = None,
        experts: ExpertParallelism | None = None,
        etp_group=None,
    ):
        """`counted` says which parameters the gradient norm counts (pipeline copies of a
        parameter count once); `extra_norm_group` sums the norm over more ranks (pp);
        `in_place` picks the all-reduce collectives (default: on gloo) over reduce-scatter and
        all-gather (module docstring); `experts`: the routed experts split over ep, whose
        space spans their expert-data-parallel group; `etp_group`: the expert tensor-parallel
        group, over which the norm sums the squares of expert weights split over etp."""
        params = [p for p in model.parameters() if p.requires_grad]
        routed = set()
        if experts is not None:
            routed = {id(model.get_parameter(n)) for n in experts.names}
        # dense parameters first, then the experts: each space is one run of the list
        self.params = [p for p in params if id(p) not in routed]
        self.params += [p for p in params if id(p) in routed]
        self.group, self.tp_group, self.etp_group = dp_group, tp_group, etp_group
        self.extra_norm_group = extra_norm_group
        self.dp = dist.get_world_size(dp_group)
        self.rank = dist.get_rank(dp_group)
        self.numels = [p.numel() for p in self.params]
        n_dense = len(self.params) - len(routed)
        runs = [(0, n_dense, dp_group, self.dp)]
        if experts is not None:
            runs.append((n_dense, len(self.params), experts.data_group, experts.dp))
        self.spaces: list[_Space] = []
        self.offsets: list[int] = []  # where each parameter starts in the flat buffer
        offset = start = 0
        for first, last, group, divide in runs:
            if first == last:  # a pipeline stage without MoE layers
                continue
            size, rank = 1, 0
            if group is not None:
                size, rank = dist.get_world_size(group), dist.get_rank(group)
            numel = sum(self.numels[first:last])
            space = _Space(group, size, rank, divide, first, last, numel, offset, start)
            self.spaces.append(space)
            at = offset
            for n in self.numels[first:last]:
                self.offsets.append(at)
                at += n
            offset, start = offset + space.padded, start + space.shard
        self.padded, self.shard = offset, start
        device = self.params[0].device
        # The owned ranges as pieces of parameters: per-parameter properties (weight decay,
        # tensor-parallel shard, counted in the norm) apply to whole pieces, so no
        # per-element masks and no full-size temporaries are built.
        self.pieces: list[_Piece] = []
        for sp in self.spaces:
            for i in range(sp.first, sp.last):
                at = self.offsets[i] - sp.offset  # where parameter i starts in its space
                a, b = max(at, sp.lo), min(at + self.numels[i], sp.hi)
                if a < b:
                    s0 = sp.start + a - sp.lo
                    self.pieces.append(_Piece(i, a - at, b - at, s0, s0 + b - a))
        self.decays = [self.params[c.index].ndim >= 2 for c in self.pieces]  # matrices only
        counts = [counted is None or counted(self.params[c.index]) for c in self.pieces]
        # Expert pieces count as replicated ones: each rank's are disjoint, and summed over
        # dp they cover every expert once (experts are replicated over tp) — save for the
        # split of their hidden width over etp, summed over that group.
        shards = [shard_of(self.params[c.index]) for c in self.pieces]
        etp = [s is not None and s.splits("etp") for s in shards]
        tp = [s is not None and s.splits("tp") for s in shards]
        # for the global grad norm: tp shards (summed over tp), etp shards (over etp) and
        # replicated, counted pieces
        self.norm_sharded = [c and t for c, t in zip(counts, tp, strict=True)]
        self.norm_etp = [c and e for c, e in zip(counts, etp, strict=True)]
        self.norm_replicated = [c and not (t or e) for c, t, e in zip(counts, tp, etp, strict=True)]
        self.master = self._shard_of([p.detach() for p in self.params])  # FP32 master slice
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0
        self.grad_shard: torch.Tensor | None = None
        self.in_place = dist.get_backend(dp_group) == "gloo" if in_place is None else in_place
        self.buffer: torch.Tensor | None = None  # the flat gradient buffer, when views work
        self.views: list[torch.Tensor] = []
        if all(p.dtype == torch.float32 and p.device == device for p in self.params):
            self.buffer = torch.zeros(self.padded, dtype=torch.float32, device=device)
            self.views = self._split(self.buffer)
            self._attach()
        # reduce-scatters' outputs, and the spaces' gradient shards side by side
        whole = not self.in_place or len(self.spaces) > 1
        self.shard_out = torch.empty(self.shard if whole else 0, dtype=torch.float32, device=device)
        self.param_groups = [{"lr": cfg.lr, "weight_decay": cfg.weight_decay}]
        self.betas, self.eps = (cfg.beta1, cfg.beta2), cfg.eps

    def _shard_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's FP32 slice of the parameters' flattened layout, read from per-parameter
        tensors piece by piece (padding is zero)."""
        out = torch.zeros(self.shard, dtype=torch.float32, device=self.params[0].device)
        for c in self.pieces:
            out[c.s0 : c.s1].copy_(tensors[c.index].reshape(-1)[c.p0 : c.p1])
        return out

    def _piece_views(self, flat: torch.Tensor, which: list[bool]) -> list[torch.Tensor]:
        return [flat[c.s0 : c.s1] for c, w in zip(self.pieces, which, strict=True) if w]

    def _flatten(self, tensors: list[torch.Tensor], device=None) -> torch.Tensor:
        device = device or self.params[0].device
        flat = torch.zeros(self.padded, dtype=torch.float32, device=device)
        for sp in self.spaces:
            torch.cat(
                [t.reshape(-1).float().to(device) for t in tensors[sp.first : sp.last]],
                out=flat[sp.offset : sp.offset + sp.numel],
            )
        return flat

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat buffer, shaped like the parameters."""
        return [
            flat[o : o + n].view_as(p)
            for p, o, n in zip(self.params, self.offsets, self.numels, strict=True)
        ]

    def _in_spaces(self, full: torch.Tensor, shard: torch.Tensor):
        """(space, its part of a flat `full`, its part of a `shard`-sized tensor) per space."""
        for sp in self.spaces:
            yield sp, full[sp.offset : sp.offset + sp.padded], shard[sp.start : sp.start + sp.shard]

    def _attach(self) -> None:
        """Point every parameter's gradient at its (zeroed) slot of the flat buffer."""
        for p, v in zip(self.params, self.views, strict=True):
            p.grad = v

    # ------------------------------------------------------------------ gradients

    def _gathered_grads(self) -> torch.Tensor:
        """The flat buffer holding this rank's accumulated gradients. Gradients that are not
        views of it (None, or replaced: a pipeline's shared-copy sum assigns a new tensor)
        are copied into their slot; None counts as zero."""
        if self.buffer is None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            return self._flatten(grads)
        for p, v in zip(self.params, self.views, strict=True):
            g = p.grad
            if g is None:
                v.zero_()
            elif g.data_ptr() != v.data_ptr():
                v.copy_(g)
        return self.buffer

    def reduce_grads(self) -> None:
        """Reduce the accumulated gradients over dp: this rank gets the dp-mean of its slice
        (of the experts' slice: the sum over their replicas divided by dp)."""
        flat = self._gathered_grads()
        # shard_out is allocated once: NCCL-style reduce-scatters need no copy
        for sp, whole, out in self._in_spaces(flat, self.shard_out):
            if sp.group is None:
                shard = whole
            elif self.in_place:
                dist.all_reduce(whole, group=sp.group)
                shard = whole[sp.lo : sp.hi]
            else:
                shard = out
                dist.reduce_scatter_tensor(shard, whole, group=sp.group)
            shard.div_(sp.divide)
            if len(self.spaces) == 1:
                self.grad_shard = shard
            elif shard.data_ptr() != out.data_ptr():
                out.copy_(shard)
        if len(self.spaces) > 1:
            self.grad_shard = self.shard_out

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm from the gradient shards (tp shards summed over tp, etp shards over
        etp, replicas once)."""
        g = self.grad_shard

        def squares(which: list[bool]) -> torch.Tensor:
            return sum_of_squares(self._piece_views(g, which), g.device)

        sharded_sq = squares(self.norm_sharded)
        replicated_sq = squares(self.norm_replicated)
        if self.tp_group is not None:
            dist.all_reduce(sharded_sq, group=self.tp_group)
        total_sq = sharded_sq + replicated_sq
        if self.etp_group is not None:
            etp_sq = squares(self.norm_etp)
            dist.all_reduce(etp_sq, group=self.etp_group)
            total_sq = total_sq + etp_sq
        dist.all_reduce(total_sq, group=self.group)
        if self.extra_norm_group is not None:
            dist.all_reduce(total_sq, group=self.extra_norm_group)
        total = total_sq.sqrt().float()
        if max_norm > 0:
            g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    # ------------------------------------------------------------------ update

    @torch.no_grad()
    def step(self) -> None:
        if self.grad_shard is None:
            raise RuntimeError("reduce_grads() must run before step()")
        lr, wd = self.param_groups[0]["lr"], self.param_groups[0]["weight_decay"]
        beta1, beta2 = self.betas
        self.step_count += 1
        g = self.grad_shard
        decayed = self._piece_views(self.master, self.decays)
        if decayed and lr * wd:
            torch._foreach_mul_(decayed, 1 - lr * wd)  # decoupled weight decay, matrices only
        self.exp_avg.lerp_(g, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1**self.step_count
        bias2 = 1 - beta2**self.step_count
        denom = self.exp_avg_sq.sqrt().div_(math.sqrt(bias2)).add_(self.eps)  # one temporary
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bias1)
        self._publish()
        self.grad_shard = None

    def _publish(self) -> None:
        """Gather the updated master slices into every rank's model parameters, through the
        gradient buffer when there is one (the gradients are spent by now)."""
        full = self.buffer
        if full is None:
            full = torch.empty(self.padded, dtype=torch.float32, device=self.master.device)
        for p in self.params:  # the buffer is about to hold weights, not gradients
            p.grad = None
        for sp, whole, mine in self._in_spaces(full, self.master):
            if sp.group is None:
                whole.copy_(mine)
            elif self.in_place:
                whole.zero_()
                whole[sp.lo : sp.hi].copy_(mine)
                dist.all_reduce(whole, group=sp.group)
            else:
                dist.all_gather_into_tensor(whole, mine, group=sp.group)
        for p, v in zip(self.params, self._split(full), strict=True):
            p.data.copy_(v)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients to zero: the flat buffer zeroed and attached again (`set_to_none` is
        accepted for the `torch.optim` interface; views of a buffer are never None)."""
        if self.buffer is None:
            for p in self.params:
                p.grad = None
            return
        self.buffer.zero_()
        self._attach()

    # ------------------------------------------------------------------ state

    def _gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(self.padded, dtype=shard.dtype, device=shard.device)
        for sp, whole, mine in self._in_spaces(full, shard):
            if sp.group is None:
                whole.copy_(mine)
            else:
                dist.all_gather_into_tensor(whole, mine.contiguous(), group=sp.group)
        return full

    def state_by_param(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's moments whole over dp (this rank's tp shard, or ep piece): a
        collective."""
        avg, avg_sq = self._gather_flat(self.exp_avg), self._gather_flat(self.exp_avg_sq)
        step = torch.tensor(float(self.step_count))
        return {
            p: {"step": step, "exp_avg": a.clone(), "exp_avg_sq": b.clone()}
            for p, a, b in zip(self.params, self._split(avg), self._split(avg_sq), strict=True)
        }

    def load_state_by_param(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        steps = {int(s["step"]) for s in state.values()}
        if len(steps) != 1:
            raise ValueError(f"optimizer state has different step counts per tensor: {steps}")
        self.step_count = steps.pop()
        self.exp_avg = self._shard_of([state[p]["exp_avg"] for p in self.params])
        self.exp_avg_sq = self._shard_of([state[p]["exp_avg_sq"] for p in self.params])
        self.master = self._shard_of([p.detach() for p in self.params])

    def local_bytes(self) -> int:
        """Optimizer bytes held here: master slice and both moments."""
        return 3 * self.master.numel() * self.master.element_size()
