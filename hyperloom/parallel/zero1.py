"""ZeRO-1 distributed optimizer: FP32 master weights and AdamW state sharded over dp.

Rajbhandari et al. (arXiv 1910.02054) observe that with Adam, 12 of the 16 bytes per
parameter of mixed-precision training are optimizer state (FP32 master copy and two
moments) that every data-parallel rank updates identically. ZeRO stage 1 gives each rank
1/dp of that state: gradients are reduce-scattered (each rank receives the averaged
gradient of its slice), each rank runs AdamW on its slice of the master weights, and the
updated slices are all-gathered back into every rank's model parameters. The traffic equals
DDP's all-reduce (a reduce-scatter plus an all-gather is an all-reduce).

Layout, as in Megatron's distributed optimizer: all parameters of this rank (tensor-parallel
shards included) are laid end to end in one flat FP32 space, padded to a multiple of dp;
rank r owns the contiguous range [r*N/dp, (r+1)*N/dp), which may cut a tensor in two. Weight
decay is a per-element mask over that range (matrices decay, vectors do not).

Gradients accumulate locally over micro-batches and are reduced once per step, so gradient
accumulation costs no extra communication. (The reduction is not yet overlapped with
backward; DDP's bucketed overlap is used for zero = 0.)

The update is `torch.optim.AdamW`'s, element for element, so a zero = 1 run equals a
single-process run to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.accelerator import norm_accumulator
from hyperloom.config import TrainConfig


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
    ):
        """`counted` says which parameters the gradient norm counts (pipeline copies of a
        parameter count once); `extra_norm_group` sums the norm over more ranks (pp)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group, self.tp_group = dp_group, tp_group
        self.extra_norm_group = extra_norm_group
        self.dp = dist.get_world_size(dp_group)
        self.rank = dist.get_rank(dp_group)
        self.numels = [p.numel() for p in self.params]
        total = sum(self.numels)
        self.padded = math.ceil(total / self.dp) * self.dp
        self.shard = self.padded // self.dp
        self.lo, self.hi = self.rank * self.shard, (self.rank + 1) * self.shard
        device = self.params[0].device
        flat = self._flatten([p.detach() for p in self.params])
        self.master = flat[self.lo : self.hi].clone()  # this rank's FP32 master weights
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0
        # Per-element masks over the owned range: weight decay (matrices only) and whether
        # the element belongs to a tensor-parallel shard (for the global grad norm).
        decay = self._flatten(
            [
                torch.full((n,), float(p.ndim >= 2))
                for p, n in zip(self.params, self.numels, strict=True)
            ],
            device,
        )
        tp_sharded = self._flatten(
            [
                torch.full((n,), float(hasattr(p, "shard_spec")))
                for p, n in zip(self.params, self.numels, strict=True)
            ],
            device,
        )
        self.decay_mask = decay[self.lo : self.hi].clone()  # a view would keep all N alive
        self.count_mask: torch.Tensor | None = None
        if counted is not None and not all(counted(p) for p in self.params):
            count = self._flatten(
                [
                    torch.full((n,), float(counted(p)))
                    for p, n in zip(self.params, self.numels, strict=True)
                ],
                device,
            )
            tp_sharded *= count
            self.count_mask = count[self.lo : self.hi].clone()
        self.tp_mask = tp_sharded[self.lo : self.hi].clone()
        self.grad_shard: torch.Tensor | None = None
        self.param_groups = [{"lr": cfg.lr, "weight_decay": cfg.weight_decay}]
        self.betas, self.eps = (cfg.beta1, cfg.beta2), cfg.eps

    def _flatten(self, tensors: list[torch.Tensor], device=None) -> torch.Tensor:
        device = device or self.params[0].device
        flat = torch.zeros(self.padded, dtype=torch.float32, device=device)
        torch.cat([t.reshape(-1).float().to(device) for t in tensors], out=flat[: sum(self.numels)])
        return flat

    # ------------------------------------------------------------------ gradients

    def reduce_grads(self) -> None:
        """Reduce-scatter the accumulated gradients: this rank gets the dp-mean of its slice."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flatten(grads)
        out = torch.empty(self.shard, dtype=torch.float32, device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        self.grad_shard = out / self.dp

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm from the gradient shards (tp shards summed over tp, replicas once)."""
        g = self.grad_shard
        acc = norm_accumulator(g.device)
        squares = g.square()
        sharded_sq = (squares * self.tp_mask).sum(dtype=acc)
        if self.count_mask is not None:
            squares *= self.count_mask
        replicated_sq = squares.sum(dtype=acc) - sharded_sq
        del squares
        if self.tp_group is not None:
            dist.all_reduce(sharded_sq, group=self.tp_group)
        total_sq = sharded_sq + replicated_sq
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
        self.master.mul_(1 - lr * wd * self.decay_mask)  # decoupled weight decay
        self.exp_avg.lerp_(g, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1**self.step_count
        bias2 = 1 - beta2**self.step_count
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bias1)
        self._publish()
        self.grad_shard = None

    def _publish(self) -> None:
        """All-gather the updated master slices into every rank's model parameters."""
        full = torch.empty(self.padded, dtype=torch.float32, device=self.master.device)
        dist.all_gather_into_tensor(full, self.master, group=self.group)
        offset = 0
        for p, n in zip(self.params, self.numels, strict=True):
            p.data.copy_(full[offset : offset + n].view_as(p))
            offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------------ state

    def _gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(self.padded, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.contiguous(), group=self.group)
        return full

    def state_by_param(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's moments whole over dp (this rank's tp shard): a collective."""
        avg, avg_sq = self._gather_flat(self.exp_avg), self._gather_flat(self.exp_avg_sq)
        out, offset = {}, 0
        step = torch.tensor(float(self.step_count))
        for p, n in zip(self.params, self.numels, strict=True):
            out[p] = {
                "step": step,
                "exp_avg": avg[offset : offset + n].view_as(p).clone(),
                "exp_avg_sq": avg_sq[offset : offset + n].view_as(p).clone(),
            }
            offset += n
        return out

    def load_state_by_param(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        steps = {int(s["step"]) for s in state.values()}
        if len(steps) != 1:
            raise ValueError(f"optimizer state has different step counts per tensor: {steps}")
        self.step_count = steps.pop()
        self.exp_avg = self._flatten([state[p]["exp_avg"] for p in self.params])[self.lo : self.hi]
        self.exp_avg_sq = self._flatten([state[p]["exp_avg_sq"] for p in self.params])[
            self.lo : self.hi
        ]
        self.exp_avg, self.exp_avg_sq = self.exp_avg.clone(), self.exp_avg_sq.clone()
        self.master = self._flatten([p.detach() for p in self.params])[self.lo : self.hi].clone()

    def local_bytes(self) -> int:
        """Optimizer bytes held here: master slice and both moments."""
        return 3 * self.master.numel() * self.master.element_size()
