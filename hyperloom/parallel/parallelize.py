"""Apply a parallel layout to a single-device model, in one fixed order: TP/SP, then EP
(`expert_parallel`, called from `parallelize`), then DP.

(Context parallelism, recompute and compile slot in between, in that order, as they land.)
A model family describes tensor parallelism as data — a plan mapping module paths
(with `*` for a layer index) to a style — and this module knows what each style means:

- "colwise" / "rowwise": Megatron column/row-parallel linears;
- "tp_input": the block's input is made whole on the group once (all-gather under sequence
  parallelism), for all the column-parallel linears inside it;
- "vocab_embedding" / "vocab_head": vocabulary-parallel embedding and output head;
- "sp_norm": a norm that runs on a sequence slice under sequence parallelism, so its
  weight gradient must be summed over the tensor-parallel group;
- "colwise_tp_input": a column-parallel linear that makes its own input whole (a "tp_input"
  on the linear alone, for a block whose other inputs need no sum: MLA's wq without q_lora);
- "tp_output_grad": a replicated module whose output feeds only this rank's shards (MLA's
  low-rank down-projections): its output gradient is summed over the group before its
  backward, so its weight and input gradients come out whole on every rank;
- "tp_partial_grad": a module that runs replicated but whose output feeds only this rank's
  heads and whose output gradient is not summed (MLA's latent norms, between a
  "tp_output_grad" down-projection and the column-parallel up-projection): each rank's
  weight gradient is a partial sum, so it is summed over the group after backward.

Data parallelism then wraps the result:
- zero = 1: our ZeRO-1 distributed optimizer (`zero1.py`): gradients reduce-scattered once
  per step, FP32 master weights and Adam moments 1/dp per rank, parameters all-gathered;
- zero = 0: PyTorch DDP (bucketed all-reduce overlapped with backward, `no_sync` for gradient
  accumulation) — well-kept machinery, nothing to gain by rewriting it;
- zero = 3: PyTorch FSDP2 (`fully_shard`, per transformer block then the root): parameters,
  gradients and Adam state are sharded over dp and all-gathered per block just in time. We
  use FSDP2 rather than our own because it is composable with our tensor-parallel modules
  (they are plain modules with plain parameters) and is what torchtitan ships.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.accelerator import sum_of_squares
from hyperloom.config import TrainConfig
from hyperloom.engine.fp8.convert import fp8_modules
from hyperloom.parallel import tensor_parallel as tpl
from hyperloom.parallel.expert_parallel import ExpertParallelExperts, ExpertParallelism
from hyperloom.parallel.mesh import ParallelMesh, all_reduce_coalesced, all_reduce_scaling_state
from hyperloom.parallel.zero1 import ZeroOneAdamW
from hyperloom.train.optim import build_optimizer

log = logging.getLogger("hyperloom.parallel")

STYLES = (
    "colwise",
    "rowwise",
    "tp_input",
    "colwise_tp_input",
    "tp_output_grad",
    "tp_partial_grad",
    "vocab_embedding",
    "vocab_head",
    "sp_norm",
)


def _modules_matching(model: nn.Module, pattern: str) -> list[str]:
    return [name for name, _ in model.named_modules() if fnmatch.fnmatchcase(name, pattern)]


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def apply_tensor_parallel(
    model: nn.Module,
    plan: dict[str, str],
    group,
    sequence_parallel: bool,
    partial: bool = False,
) -> list[str]:
    """Swap in the plan's parallel modules (model may be on the meta device).

    `partial`: the model is a pipeline chunk, so plan entries may match nothing (a middle
    chunk has no embedding and no head). Returns the names of the parameters whose gradients
    must be summed over the group after backward (norm weights under sequence parallelism).
    """
    sp_params: list[str] = []
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"unknown tensor-parallel style {style!r} for {pattern!r}")
        paths = _modules_matching(model, pattern)
        tied_head = style == "vocab_head" and getattr(model, pattern, 1) is None
        if not paths and not tied_head and not partial:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module")
        if tied_head:  # tied embeddings: the head borrows them
            emb = next(
                (m for m in model.modules() if isinstance(m, tpl.VocabParallelEmbedding)), None
            )
            if emb is None:  # a pipeline chunk without the embedding has no head either
                continue
            _set_submodule(
                model, pattern, tpl.VocabParallelHead(emb, group, sequence_parallel, True)
            )
            continue
        for path in paths:
            old = model.get_submodule(path)
            if style == "colwise":
                _set_submodule(model, path, tpl.ColumnParallelLinear(old, group))
            elif style == "rowwise":
                _set_submodule(model, path, tpl.RowParallelLinear(old, group, sequence_parallel))
            elif style == "vocab_embedding":
                new = tpl.VocabParallelEmbedding(old, group, sequence_parallel)
                _set_submodule(model, path, new)
            elif style == "vocab_head":
                new = tpl.VocabParallelHead(old, group, sequence_parallel, tied=False)
                _set_submodule(model, path, new)
            elif style == "tp_input":
                tpl.prepare_tp_input(old, group, sequence_parallel)
            elif style == "colwise_tp_input":
                new = tpl.ColumnParallelLinear(old, group)
                tpl.prepare_tp_input(new, group, sequence_parallel)
                _set_submodule(model, path, new)
            elif style == "tp_output_grad":
                tpl.prepare_tp_output_grad(old, group)
            elif style == "tp_partial_grad" or (style == "sp_norm" and sequence_parallel):
                sp_params.extend(f"{path}.{n}" for n, _ in old.named_parameters())
    return sp_params


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

    def shard_group(self, p: torch.Tensor):
        """The group a sharded parameter (`shard_spec`) is split over: ep for expert
        weights, else tp."""
        if getattr(p, "shard_group", "tp") == "ep":
            return self.experts.group
        return self.tp_group

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; vocab-parallel when the head is."""
        return tpl.vocab_parallel_cross_entropy(logits, labels, self.tp_group)

    def sync_context(self, last_micro_batch: bool):
        """Skip the data-parallel gradient reduction on all but the last micro-batch."""
        if last_micro_batch or self.mesh.size("dp") == 1 or self.zero == 1:
            return contextlib.nullcontext()  # zero = 1 reduces once, in the optimizer
        if self.zero == 0:
            return self.module.no_sync()
        return _fsdp_no_sync(self.inner)

    def sync_fp8_replicas(self, recent: int | None = None) -> None:
        """Delayed FP8 scaling under data parallelism: the ranks holding a replica of an FP8
        layer quantized different micro-batches, so their amax histories differ in the rows
        recorded since the last call (`recent`; None: compare whole histories). Reduce them
        (elementwise max, scales min) over the replicas: dp for every layer, the
        expert-data-parallel group for experts split over ep. Afterwards every replica holds
        what one process quantizing all the replicas' micro-batches as one would record, so
        the next scales equal that process's and the one copy a checkpoint keeps resumes
        every rank. TE reduces amaxes over its `fp8_group` in the same way (Megatron's amax
        reduction group spans dp and tp). Stateless recipes have nothing to reduce."""
        dp_group = self.mesh.group("dp")
        if dp_group is None:
            return
        plain, experts = ([], []), ([], [])
        for _, m in fp8_modules(self.inner):
            if m.fp8_amax_history is not None:
                into = experts if isinstance(m, ExpertParallelExperts) else plain
                into[0].append(m.fp8_amax_history)
                into[1].append(m.fp8_scale)
        all_reduce_scaling_state(*plain, dp_group, recent)
        if experts[0]:
            all_reduce_scaling_state(*experts, self.experts.data_group, recent)

    def make_optimizer(self, cfg: TrainConfig):
        """AdamW for this layout: the ZeRO-1 sharded one for zero = 1 with dp > 1."""
        if self.zero == 1 and self.mesh.size("dp") > 1:
            return ZeroOneAdamW(self.inner, cfg, self.mesh.group("dp"), self.tp_group)
        return build_optimizer(self.inner, cfg)

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
        if self.zero == 3 and self.mesh.size("dp") > 1:
            for m in self.inner.modules():
                if hasattr(m, "reshard"):
                    m.reshard()

    def finish_grads(self) -> None:
        """After backward: sum the sequence-parallel norms' weight gradients over tp;
        reduce the expert weights' gradients (which DDP leaves alone) over their replicas."""
        if self.experts is not None:
            self.experts.reduce_grads(self.inner)
        group = self.tp_group
        if group is None:
            return
        grads = [self.inner.get_parameter(n).grad for n in self.sp_params]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
        all_reduce_coalesced(grads, group)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over the whole layout; scales gradients down to `max_norm`.

        Tensor-parallel shards contribute their squares summed over tp, expert weights
        theirs summed over ep; replicated parameters count once. Under FSDP every dp rank
        holds a disjoint shard, so the sum also runs over dp. Same formula as
        `torch.nn.utils.clip_grad_norm_`.
        """
        sharded, experts, replicated, every = [], [], [], []
        for p in self.inner.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            every.append(g)
            if id(p) in self.norm_skip:  # a second copy (pipeline) counts once
                continue
            if getattr(p, "shard_group", None) == "ep":
                experts.append(g)
            else:
                (sharded if getattr(p, "shard_spec", None) else replicated).append(g)
        dev = next(self.inner.parameters()).device
        # float64 sums of float32 slice norms: layouts agree with one process
        sharded_sq = sum_of_squares(sharded, dev)
        if self.tp_group is not None:
            dist.all_reduce(sharded_sq, group=self.tp_group)
        total_sq = sharded_sq + sum_of_squares(replicated, dev)
        if self.experts is not None:
            expert_sq = sum_of_squares(experts, dev)
            dist.all_reduce(expert_sq, group=self.experts.group)
            total_sq = total_sq + expert_sq
        if self.zero == 3 and self.mesh.group("dp") is not None:
            dist.all_reduce(total_sq, group=self.mesh.group("dp"))
        if self.mesh.group("pp") is not None:  # each pipeline rank holds other layers
            dist.all_reduce(total_sq, group=self.mesh.group("pp"))
        total = total_sq.sqrt().float()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            if every:
                torch._foreach_mul_(every, coef)
        return total


def _reduce_each_gradient(group, bucket):  # DDP rejects the annotations as strings
    """DDP communication hook: the bucket's mean over dp, one all-reduce per gradient (the
    gradients are views of the bucket's buffer), as `wrap_data_parallel` explains; returns
    the future of the reduced buffer."""
    grads, buffer = bucket.gradients(), bucket.buffer()
    size = dist.get_world_size(group)
    torch._foreach_div_(grads, size)  # DDP's own hook divides before it sums, too
    works = [dist.all_reduce(g, group=group, async_op=True).get_future() for g in grads]
    return torch.futures.collect_all(works).then(lambda _: buffer)


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def wrap_data_parallel(
    model: nn.Module,
    mesh: ParallelMesh,
    zero: int,
    ignore: list[str] = (),
    routed: bool = False,
) -> nn.Module:
    """DDP (zero 0) or FSDP2 (zero 3) over the dp dimension; the model itself when dp = 1 or
    zero = 1 (whose optimizer does the data-parallel reduction). DDP leaves the parameters
    named in `ignore` alone (expert weights, reduced over their own replicas).

    `routed` (a MoE model) at dp > 2: DDP all-reduces each gradient on its own
    (`_reduce_each_gradient`) instead of each bucket's flat buffer. DDP rebuilds its buckets
    once, in the order the first backward made the gradients ready, and a MoE's routing
    changes that order from step to step; a ring all-reduce over more than two ranks sums an
    element in an order set by its place in the buffer, so a run resumed from a checkpoint
    (whose first backward is another step's) summed some gradients in another order than the
    run that went on: 6e-8 apart a step later, measured. Per gradient, an element's place is
    its place in its own tensor. Two ranks add a + b whatever the place; dense models keep
    one order. The cost is one collective per parameter tensor instead of one per 25 MB."""
    if mesh.size("dp") == 1 or zero == 1:
        return model
    if zero == 0:
        from torch.nn.parallel import DistributedDataParallel

        if ignore:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
        # Gradients as views of the all-reduce buckets: without it the buckets are a second
        # FP32 copy of every gradient (dp2 on the default model: ~88 MB per rank).
        ddp = DistributedDataParallel(
            model,
            process_group=mesh.group("dp"),
            broadcast_buffers=False,
            bucket_cap_mb=25,
            gradient_as_bucket_view=True,
        )
        if routed and mesh.size("dp") > 2:
            ddp.register_comm_hook(mesh.group("dp"), _reduce_each_gradient)
        return ddp
    from torch.distributed.fsdp import fully_shard

    # FSDP2 replaces each parameter with a DTensor one; carry the tensor-parallel shard
    # description over so clipping and checkpoints still know which tensors are tp slices.
    attrs = shard_attributes(model)
    dp_mesh = mesh.submesh("dp")
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    restore_shard_attributes(model, attrs)
    return model


SHARD_ATTRIBUTES = ("shard_spec", "shard_group")


def shard_attributes(model: nn.Module) -> dict[str, dict[str, object]]:
    """Parameter name -> the shard description a parallel layer attached to it. Wrappers
    (FSDP2) and `to_empty` make new Parameter objects; `restore_shard_attributes` carries the
    descriptions across by name."""
    return {
        n: {a: getattr(p, a) for a in SHARD_ATTRIBUTES if hasattr(p, a)}
        for n, p in model.named_parameters()
        if hasattr(p, "shard_spec")
    }


def restore_shard_attributes(model: nn.Module, attrs: dict[str, dict[str, object]]) -> None:
    for name, values in attrs.items():
        p = model.get_parameter(name)
        for a, v in values.items():
            setattr(p, a, v)
