"""Gradient accumulation with overlapped forward-backward pairs: `parallel.ep_overlap` at
pp = 1.

Without a pipeline the step's m micro-batches run F0, then `Duet(F_i, B_{i-1})` for
i = 1..m-1, then B_{m-1}: micro-batch i's forward computes while micro-batch i-1's
expert-parallel all-to-alls are in flight, and the other way round (`overlap.Duet`). This is
Megatron-Core's "EP A2A overlap" of 1F1B steady states (the combined forward-backward of
`--overlap-moe-expert-parallel-comm`), with gradient accumulation's micro-batches for the
pipeline's. Each lane runs exactly the operations it runs alone, and the step keeps the
sequential order wherever order changes a number:

- forwards run F0, F1, ... and backwards B0, B1, ..., so every gradient accumulates its
  micro-batches in the sequential order, the MoE routers count their loads in it, and the
  loader hands out the batches in it (fetched on the caller's thread between pairs, so no
  lane draws from the global RNG while a recomputing lane has it reset);
- delayed FP8 scaling keeps one history column per GEMM operand, forward columns touched by
  F_i and backward ones by B_{i-1}: reducing the replicas' newest rows after each pair
  (`ParallelModel.sync_fp8_replicas`, an idempotent max) hands F_{i+1} and B_i the
  histories the sequential run hands them;
- the step's loss adds the micro-batches' losses in order.

Data parallelism. DDP arms its reducer in a forward that runs with gradient sync on
(`prepare_for_backward`), so a synced F_{m-1} beside B_{m-2} would reduce B_{m-2}'s partial
gradients. So every micro-batch runs under `no_sync` and the dense gradients are reduced
once afterwards as DDP reduces them: divided by dp x cp first, then summed, one collective
per gradient as DDP's hook for MoE models does at more than two ranks
(`data_parallel._reduce_each_gradient`), all together at two (a + b sums alike in any
layout). The losses, gradients and weights equal the sequential step's bit for bit. ZeRO-1
reduces in its optimizer after the step, untouched here. FSDP2 (zero = 3) gathers a block's
parameters in its forward hooks and frees them after its backward, which two interleaved
micro-batches would do to each other's blocks: the config refuses it.

Cost: two micro-batches' activations are alive at once (F_i's and B_{i-1}'s), as in a 1F1B
steady state; and one more amax reduction per step under delayed FP8 with dp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hyperloom.parallel.mesh import all_reduce_coalesced
from hyperloom.parallel.overlap import Duet

if TYPE_CHECKING:
    from hyperloom.parallel.layout import ParallelModel

Batch = tuple[torch.Tensor, torch.Tensor]


class OverlappedAccumulation:
    """One optimizer step's forwards and backwards over `pm` with micro-batch i's forward
    beside micro-batch i-1's backward (module docstring). `trace` holds the last step's
    duets, in order, for timelines and tests."""

    def __init__(self, pm: ParallelModel):
        if pm.pipelined or pm.zero == 3:
            raise ValueError(
                "overlapped gradient accumulation runs an unpipelined model under DDP or "
                f"ZeRO-1 (got pipelined={pm.pipelined}, zero={pm.zero})"
            )
        self.pm = pm
        self.trace: list[Duet] = []

    def run(
        self,
        micro_batches: int,
        next_batch: Callable[[], Batch],
        loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Forward and backward of `micro_batches` batches drawn from `next_batch`, each
        micro-batch's loss from `loss_of(inputs, labels)` (already scaled for accumulation;
        it enters its own autocast). Leaves the data-parallel mean of the gradients in
        `.grad` as DDP would (nothing for ZeRO-1) and returns the sum of the losses."""
        pm = self.pm
        losses: list[torch.Tensor | None] = [None] * micro_batches

        def forward(i: int, batch: Batch) -> None:
            losses[i] = loss_of(*batch)

        def backward(i: int) -> None:
            losses[i].backward()

        self.trace = []
        with pm.sync_context(last_micro_batch=False):  # DDP: no_sync for every micro-batch
            forward(0, next_batch())
            pm.sync_fp8_replicas(recent=1)
            for i in range(1, micro_batches):
                batch = next_batch()
                duet = Duet((f"F{i}", f"B{i - 1}"))
                duet.run(functools.partial(forward, i, batch), functools.partial(backward, i - 1))
                self.trace.append(duet)
                pm.sync_fp8_replicas(recent=1)  # F_i's and B_{i-1}'s newest amaxes
            backward(micro_batches - 1)
            pm.sync_fp8_replicas(recent=1)
        if pm.zero == 0:
            dp_mean_like_ddp(pm)
        total = torch.zeros_like(losses[0], dtype=torch.float32)
        for loss in losses:
            total += loss.detach()
        return total


@torch.no_grad()
def dp_mean_like_ddp(pm: ParallelModel) -> None:
    """The reduction DDP runs in a synced backward, run by hand: every gradient DDP owns
    (not the expert weights, which `finish_grads` reduces over their replicas) divided by
    dp x cp, then summed over dp x cp (module docstring). A no-op without data parallelism."""
    group = pm.mesh.group("dcp")
    if group is None:
        return
    experts = set(pm.experts.names) if pm.experts is not None else set()
    params = [p for n, p in pm.inner.named_parameters() if p.requires_grad and n not in experts]
    for p in params:
        if p.grad is None:  # a parameter no micro-batch reached: DDP would sum zeros
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    size = dist.get_world_size(group)
    torch._foreach_div_(grads, size)  # DDP divides before it sums
    if size == 2:
        all_reduce_coalesced(grads, group)
        return
    for work in [dist.all_reduce(g, group=group, async_op=True) for g in grads]:
        work.wait()
