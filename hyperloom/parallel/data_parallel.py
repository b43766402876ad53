"""Data parallelism, the last slot of the recipe: the model replicated over dp, its gradients
averaged.

zero = 0 is PyTorch DDP (bucketed all-reduce overlapped with backward); zero = 1 leaves the
model alone and lets our ZeRO-1 optimizer (`zero1.py`) shard the FP32 master weights and Adam
moments; zero = 3 is PyTorch FSDP2 (`fully_shard` per block, then the root), which composes
with our plain tensor-parallel modules. Under pipeline parallelism the pipeline reduces over
dp itself after the schedule, since a split backward accumulates weight gradients outside
autograd's hooks.

FSDP2 leaves whole the parameters no gradient reaches (a MoE router's `expert_bias`, which
balancing moves in place after each step, on every rank alike), and shards expert banks split
over ep over their own replicas (the expert-data-parallel group), like torchtitan. Under
expert tensor parallelism (`parallel.etp`) a bank's parameters are already this rank's etp
slices of its experts: FSDP2 shards the slice (its `Shard` record, ep then etp, carried over),
and the gradient norm sums a slice's squares over etp before the sum over dp
(`ParallelModel.clip_grad_norm`).

FSDP2's mixed precision (`parallel.fsdp_param_dtype`, `fsdp_reduce_dtype`; PyTorch's
`MixedPrecisionPolicy`, as torchtitan sets it): the sharded parameters, which the optimizer
steps, stay FP32; each block's all-gather casts its shard to the param dtype first, so BF16
gathers move half the bytes, and the block runs on BF16 weights and BF16 inputs (module-level
mixed precision: its activations and residual stream are BF16 too, where autocast keeps the
residual FP32). Gradients are cast to the reduce dtype before the reduce-scatter; with FP32
reduction they accumulate (no_sync) and land in the FP32 shards without a BF16 rounding of
the sum over dp.

HSDP (`parallel.dp_replicate`: the hybrid sharding of Zhao et al. 2023, "PyTorch FSDP", arXiv
2304.11277) hands `fully_shard` a 2-D mesh (`ParallelMesh.submesh`): parameters sharded
within each replica group and replicated across the groups; gradients reduce-scattered
within a group, then all-reduced across the replicas, so each rank gathers over dp x cp /
dp_replicate ranks instead of all of dp x cp.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.models.shard import restore_shards, shards_by_name
from hyperloom.parallel.expert_parallel import ExpertParallelExperts, ExpertParallelism
from hyperloom.parallel.mesh import ParallelMesh

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


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
def fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def wrap_data_parallel(
    model: nn.Module,
    mesh: ParallelMesh,
    zero: int,
    experts: ExpertParallelism | None = None,
    routed: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """DDP (zero 0) or FSDP2 (zero 3) over the dp dimension; the model itself when dp = 1 or
    zero = 1 (whose optimizer does the data-parallel reduction). DDP leaves the `experts`
    (split over ep) alone: they are reduced over their own replicas; FSDP2 shards them over
    those (`_shard_experts`). `mp_policy`: FSDP2's `MixedPrecisionPolicy` (`fsdp_policy`),
    for every group it shards.

    `routed` (a MoE model) at dp > 2: DDP all-reduces each gradient on its own
    (`_reduce_each_gradient`) instead of each bucket's flat buffer. DDP rebuilds its buckets
    once, in the order the first backward made the gradients ready, and a MoE's routing
    changes that order from step to step; a ring all-reduce over more than two ranks sums an
    element in an order set by its place in the buffer, so a run resumed from a checkpoint
    (whose first backward is another step's) summed some gradients in another order than the
    run that went on: 6e-8 apart a step later, measured. Per gradient, an element's place is
    its place in its own tensor. Two ranks add a + b whatever the place; dense models keep
    one order. The cost is one collective per parameter tensor instead of one per 25 MB."""
    if mesh.size("dcp") == 1 or zero == 1:
        return model
    if zero == 0:
        from torch.nn.parallel import DistributedDataParallel

        if experts is not None:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, experts.names
            )
        # Gradients as views of the all-reduce buckets: without it the buckets are a second
        # FP32 copy of every gradient (dp2 on the default model: ~88 MB per rank).
        ddp = DistributedDataParallel(
            model,
            process_group=mesh.group("dcp"),
            broadcast_buffers=False,
            bucket_cap_mb=25,
            gradient_as_bucket_view=True,
        )
        if routed and mesh.size("dcp") > 2:
            ddp.register_comm_hook(mesh.group("dcp"), _reduce_each_gradient)
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2 replaces each parameter with a DTensor one; carry the `Shard` records over so
    # clipping and checkpoints still know which tensors are tp slices.
    shards = shards_by_name(model)
    hsdp = mesh.size("dp_replicate") > 1
    dp_mesh = mesh.submesh("dp_replicate", "dp_shard") if hsdp else mesh.submesh("dcp")
    mp = mp_policy or MixedPrecisionPolicy()
    whole = {p for p in model.parameters() if not p.requires_grad}  # routing biases
    if experts is not None:
        whole |= _shard_experts(model, experts, mesh.device_mesh.device_type, mp)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, ignored_params=whole, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, ignored_params=whole, mp_policy=mp)
    restore_shards(model, shards)
    return model


def fsdp_policy(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy | None:
    """FSDP2's `MixedPrecisionPolicy` for `parallel.fsdp_param_dtype` / `fsdp_reduce_dtype`
    ("fp32" or "bf16"); None (FSDP2's default, all FP32) when both are fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype == reduce_dtype == "fp32":
        return None
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return MixedPrecisionPolicy(param_dtype=dtypes[param_dtype], reduce_dtype=dtypes[reduce_dtype])


def _shard_experts(
    model: nn.Module, experts: ExpertParallelism, device_type: str, mp_policy: MixedPrecisionPolicy
) -> set:
    """FSDP2 on each expert bank (this rank's experts, or their etp slices) over the
    expert-data-parallel group; the sharded gradient is summed there and divided by the whole
    dp, as `ExpertParallelism.reduce_grads` makes it.
    Without that group (dp x cp = ep) nothing to shard: returns the expert parameters, to be
    left alone (`finish_grads` reduces them)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if experts.data_group is None:
        return {model.get_parameter(n) for n in experts.names}
    data_mesh = DeviceMesh.from_group(experts.data_group, device_type)
    for bank in [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]:
        fully_shard(bank, mesh=data_mesh, mp_policy=mp_policy)
        bank.set_gradient_divide_factor(experts.dp)
        bank.set_force_sum_reduction_for_comms(True)  # a sum, then / dp: gloo has no PREMUL_SUM
    return set()
