"""`ParallelModel`: a parallelized model and what the training loop needs from its layout —
the loss, when gradients are reduced, how they are finished and clipped, FP8 scaling state
kept equal over replicas. The pipeline's `PipelineModel` extends it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.accelerator import sum_of_squares
from hyperloom.engine.fp8.convert import fp8_modules
from hyperloom.models.shard import Shard, shard_of
from hyperloom.parallel import tensor_parallel as tpl
from hyperloom.parallel.data_parallel import fsdp_no_sync
from hyperloom.parallel.expert_parallel import ExpertParallelExperts, ExpertParallelism
from hyperloom.parallel.mesh import ParallelMesh, all_reduce_coalesced, all_reduce_scaling_state
from hyperloom.parallel.zero1 import ZeroOneAdamW


@dataclass
class ParallelModel:
    """A parallelized model and the operations the training loop needs from its layout."""

    module: nn.Module  # what the loop calls (DDP-wrapped for zero = 0 with dp > 1)
    inner: nn.Module  # the model itself, for state dicts and generation
    mesh: ParallelMesh
    zero: int
    sp_params: list[str] = field(default_factory=list)  # names; see finish_grads
    # ids of parameter copies the gradient norm must not count twice (pipeline replicas)
    norm_skip: frozenset[int] = frozenset()
    experts: ExpertParallelism | None = None  # expert weights split over ep (MoE models)
    compiled: nn.Module | None = None  # torch.compile of `module` (train.compile)

    @property
    def forward_module(self) -> nn.Module:
        """What a training or evaluation forward calls: the compiled module if there is one."""
        return self.module if self.compiled is None else self.compiled

    def norm_counted(self, p: nn.Parameter) -> bool:
        """Whether `p`'s gradient counts in the global norm (a pipeline's second copy of a
        parameter does not)."""
        return id(p) not in self.norm_skip

    @property
    def pipelined(self) -> bool:
        return False

    def state_params(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) this rank reports in a checkpoint (each name once overall)."""
        return list(self.inner.named_parameters())

    def local_params(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) for every parameter copy this rank holds (loads fill them all)."""
        return list(self.inner.named_parameters())

    def gather_state(self, state: dict) -> dict:
        """Merge per-rank name-keyed state into the whole model's (pipelines override)."""
        return state

    @property
    def tp_group(self):
        return self.mesh.group("tp")

    def group_of(self, shard: Shard):
        """The process group one split of a `Shard` runs over: ep for routed experts, etp
        for their hidden width (expert tensor parallelism), else tp."""
        if shard.over == "ep":
            return self.experts.group
        if shard.over == "etp":
            return self.mesh.group("etp")
        return self.tp_group

    def whole(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`t` (parameter `p`, its gradient, or a moment shaped like it) as the whole tensor:
        gathered over dp for an FSDP2 DTensor, then over p's shard groups, innermost split
        first (a collective)."""
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        t = t.detach()
        shard = shard_of(p)
        for split in [] if shard is None else shard.gather_order():
            group = self.group_of(split)
            if group is None:
                continue
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=split.dim)
        return t

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; vocab-parallel when the head is."""
        return tpl.vocab_parallel_cross_entropy(logits, labels, self.tp_group)

    def sync_context(self, last_micro_batch: bool):
        """Skip the data-parallel gradient reduction on all but the last micro-batch."""
        if last_micro_batch or self.mesh.size("dcp") == 1 or self.zero == 1:
            return contextlib.nullcontext()  # zero = 1 reduces once, in the optimizer
        if self.zero == 0:
            return self.module.no_sync()
        return fsdp_no_sync(self.inner)

    def sync_fp8_replicas(self, recent: int | None = None) -> None:
        """Delayed FP8 scaling under data parallelism: the ranks holding a replica of an FP8
        layer quantized different micro-batches, so their amax histories differ in the rows
        recorded since the last call (`recent`; None: compare whole histories). Reduce them
        (elementwise max, scales min) over the replicas: dp for every layer, the
        expert-data-parallel group for experts split over ep. Afterwards every replica holds
        what one process quantizing all the replicas' micro-batches as one would record, so
        the next scales equal that process's and the one copy a checkpoint keeps resumes
        every rank. TE reduces amaxes over its `fp8_group` in the same way (Megatron's amax
        reduction group spans dp and tp). Stateless recipes have nothing to reduce. Modules
        whose gradients are summed over tp (sp_params: under sp, DeepSeek's routed experts
        see this rank's tokens only) are replicas over tp too, reduced over it first."""
        dp_group = self.mesh.group("dcp")
        sliced = {n.rpartition(".")[0] for n in self.sp_params}
        plain, experts, over_tp = ([], []), ([], []), ([], [])
        for name, m in fp8_modules(self.inner):
            if m.fp8_amax_history is not None and name in sliced:
                over_tp[0].append(m.fp8_amax_history)
                over_tp[1].append(m.fp8_scale)
        all_reduce_scaling_state(*over_tp, self.tp_group, recent)
        if dp_group is None:
            return
        for _, m in fp8_modules(self.inner):
            if m.fp8_amax_history is not None:
                into = experts if isinstance(m, ExpertParallelExperts) else plain
                into[0].append(m.fp8_amax_history)
                into[1].append(m.fp8_scale)
        all_reduce_scaling_state(*plain, dp_group, recent)
        if experts[0]:
            all_reduce_scaling_state(*experts, self.experts.data_group, recent)

    def reduce_and_clip(self, optimizer, max_norm: float) -> torch.Tensor:
        """Finish the gradients (sequence-parallel sums, ZeRO-1 reduce-scatter) and clip
        them to `max_norm` by their global norm, which is returned."""
        self.finish_grads()
        if isinstance(optimizer, ZeroOneAdamW):
            optimizer.reduce_grads()
            return optimizer.clip_grad_norm(max_norm)
        return self.clip_grad_norm(max_norm)

    def reshard(self) -> None:
        """FSDP keeps the root's parameters gathered after a forward that has no backward
        (evaluation); put them back in their sharded form before anything reads them."""
        if self.zero == 3 and self.mesh.size("dcp") > 1:
            for m in self.inner.modules():
                if hasattr(m, "reshard"):
                    m.reshard()

    def finish_grads(self) -> None:
        """After backward: sum the sequence-parallel norms' weight gradients over tp (expert
        slices split over etp < tp: over the ranks holding the same slice, "etp_replica");
        reduce the expert weights' gradients (which DDP leaves alone) over their replicas."""
        if self.experts is not None and self.reduces_expert_grads():
            self.experts.reduce_grads(self.inner)
        if self.tp_group is None:
            return
        by_group: dict[str, list[torch.Tensor]] = {"tp": [], "etp_replica": []}
        for n in self.sp_params:
            p = self.inner.get_parameter(n)
            if p.grad is not None:
                split = shard_of(p) is not None and shard_of(p).splits("etp")
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                by_group["etp_replica" if split else "tp"].append(g)
        for dim, grads in by_group.items():
            all_reduce_coalesced(grads, self.mesh.group(dim))

    def reduces_expert_grads(self) -> bool:
        """Whether `finish_grads` reduces the expert gradients: not under ZeRO-1, whose
        optimizer does, nor under FSDP2 where it shards them over their replicas
        (`wrap_data_parallel`: when dp x cp > ep)."""
        if self.zero == 1:
            return False
        return not (self.zero == 3 and self.experts.data_group is not None)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over the whole layout; scales gradients down to `max_norm`.

        Tensor-parallel shards contribute their squares summed over tp, expert weights
        theirs summed over ep, and over etp where expert tensor parallelism splits them (once:
        the other etp groups of the tp group hold the same slices); replicated parameters
        count once. Under FSDP every dp rank holds a disjoint shard, so the sum also runs over
        dp (for expert weights that sum alone: each rank holds a disjoint part of them). Same
        formula as `torch.nn.utils.clip_grad_norm_`.
        """
        # the groups a parameter's squares are summed over, by its splits (innermost first)
        kinds = [(), ("tp",), ("ep",), ("etp",), ("etp", "ep")]
        by_kind: dict[tuple[str, ...], list[torch.Tensor]] = {k: [] for k in kinds}
        every = []
        for p in self.inner.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            every.append(g)
            if id(p) in self.norm_skip:  # a second copy (pipeline) counts once
                continue
            shard = shard_of(p)
            kind = () if shard is None else tuple(s.over for s in shard.gather_order())
            by_kind[kind].append(g)
        dev = next(self.inner.parameters()).device
        groups = {"tp": self.tp_group, "etp": self.mesh.group("etp")}
        # under FSDP the dp sum below covers the ep ranks
        groups["ep"] = self.experts.group if self.experts is not None and self.zero != 3 else None
        # float64 sums of float32 slice norms: layouts agree with one process. The same
        # collectives on every rank, whatever parameters it holds.
        total_sq = None
        for kind in kinds:
            sq = sum_of_squares(by_kind[kind], dev)
            for over in kind:
                if groups[over] is not None:
                    dist.all_reduce(sq, group=groups[over])
            total_sq = sq if total_sq is None else total_sq + sq
        # HSDP: the replicas hold equal shards, so over one replica group (dp_shard is dcp
        # without HSDP)
        if self.zero == 3 and self.mesh.group("dp_shard") is not None:
            dist.all_reduce(total_sq, group=self.mesh.group("dp_shard"))
        if self.mesh.group("pp") is not None:  # each pipeline rank holds other layers
            dist.all_reduce(total_sq, group=self.mesh.group("pp"))
        total = total_sq.sqrt().float()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            if every:
                torch._foreach_mul_(every, coef)
        return total
