"""The parallelize recipe: where a single-device model becomes this rank's part of a parallel
layout, for the plain and the pipeline path alike.

Slots, in this fixed order, each its own module:

1. fp8 (`parallel.fp8`): FP8 linears first, since the parallel layers wrap them;
2. tensor (`parallel.tensor_parallel`): the family's tensor/sequence-parallel plan;
3. context (`parallel.context_parallel`): attention, RoPE and loss over the cp ranks;
4. expert (`parallel.expert_parallel`): each rank keeps E / ep experts of every bank, then
   (`parallel.expert_tensor_parallel`, `parallel.etp`) 1/etp of each one's hidden width;
5. recompute (`parallel.recompute`): activation checkpointing by `train.recompute`, on the
   decoder's blocks and a tower's (a vlm's encoder); then the frozen parameters
   (`train.freeze`, `models.freeze`) stop requiring gradients;
6. data parallel (`parallel.data_parallel`): DDP, ZeRO-1 or FSDP2 over dp (FSDP2 with its
   mixed-precision policy, and as HSDP under `parallel.dp_replicate`);
7. compile (`train.compile`), last, so dynamo sees DDP's hooks.

Slots 1-5 run on the meta device, on a whole model or a pipeline chunk; `materialize` then
allocates this rank's shards and draws every tensor from the single-device init stream, so all
layouts start from the same weights; slots 6-7 wrap the result (`build_parallel_model`). The
recipe knows no model family: callers hand it the family's plans (tensor parallel, recompute).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hyperloom.config import JobConfig
from hyperloom.engine.fp8 import reset_fp8_state
from hyperloom.engine.ops import OpImpls, use_ops
from hyperloom.models.freeze import apply_freeze
from hyperloom.models.registry import ModelFamily, build_model, family
from hyperloom.models.shard import restore_shards, shards_by_name
from hyperloom.parallel.context_parallel import apply_context_parallel, context_shard
from hyperloom.parallel.data_parallel import fsdp_policy, wrap_data_parallel
from hyperloom.parallel.expert_parallel import ExpertParallelism, apply_expert_parallel
from hyperloom.parallel.expert_tensor_parallel import apply_expert_tensor_parallel
from hyperloom.parallel.fp8 import apply_fp8
from hyperloom.parallel.layout import ParallelModel
from hyperloom.parallel.mesh import ParallelMesh
from hyperloom.parallel.recompute import apply_recompute
from hyperloom.parallel.tensor_parallel import apply_tensor_parallel

SLOTS = ("fp8", "tensor", "context", "expert", "recompute", "data_parallel", "compile")


@dataclass
class Sharding:
    """What the meta-device slots did to one model or chunk, for the layout to use later."""

    # parameters whose gradients are summed over tp after backward (sequence-parallel norms;
    # expert slices split over etp < tp: over the ranks holding the same slice)
    sp_params: list[str] = field(default_factory=list)
    experts: ExpertParallelism | None = None  # routed experts split over ep
    etp_params: list[str] = field(default_factory=list)  # expert weights split over etp
    recomputed: int = 0  # blocks that recompute (train.recompute)
    frozen: list[str] = field(default_factory=list)  # parameters that do not train


def parallelize(
    model: nn.Module,
    job: JobConfig,
    mesh: ParallelMesh,
    plans: ModelFamily,
    *,
    partial: bool = False,
) -> Sharding:
    """Slots 1-5 on `model` (on the meta device), with the plans of the model's family.
    `partial`: the model is a pipeline chunk, so plan entries, expert banks and blocks may
    be absent from it."""
    par = job.parallel
    apply_fp8(model, job)
    out = Sharding()
    if mesh.size("tp") > 1:
        out.sp_params = apply_tensor_parallel(
            model, plans.tp_plan(job.model), mesh.group("tp"), par.sp, partial=partial
        )
    context = context_shard(mesh, par.cp_comm)
    if context is not None:
        apply_context_parallel(model, context)
    if par.ep > 1:
        ep_group, data_group = mesh.expert_groups(par.ep)  # created once per mesh
        out.experts = apply_expert_parallel(
            model,
            ep_group,
            data_group,
            ep_rank=mesh.rank("dcp") % par.ep,
            ep=par.ep,
            dp=mesh.size("dcp"),
            dispatcher=par.ep_dispatcher,
            partial=partial,
        )
    if mesh.size("etp") > 1:
        sp = par.sp and mesh.size("tp") > 1
        out.etp_params = apply_expert_tensor_parallel(
            model, mesh.group("etp"), mesh.rank("etp"), mesh.size("etp"), partial, sp
        )
        # Under sp a slice's gradient comes from its etp group's rows: with etp = tp those are
        # the whole tp group's (no sum after); with etp < tp the slice's other holders saw the
        # other rows, so it stays a partial sum, over "etp_replica" (`finish_grads`).
        if mesh.size("etp") == mesh.size("tp"):
            split = set(out.etp_params)
            out.sp_params = [n for n in out.sp_params if n not in split]
    t = job.train
    out.recomputed = apply_recompute(
        model, t.recompute, t.recompute_layers, plans.recompute_plan(job.model), partial=partial
    )
    towers = plans.tower_recompute_plans(job.model) if plans.tower_recompute_plans else {}
    for path, plan in towers.items():  # a vlm's encoder blocks take the same policy
        tower = getattr(model, path, None)
        if tower is not None:
            apply_recompute(tower, t.recompute, t.recompute_layers, plan, partial=True)
    out.frozen = apply_freeze(model, t.freeze)
    return out


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate the (sharded) meta model on `device` and initialise it from `seed`."""
    # to_empty makes new Parameter objects: the Shard records are carried across by name
    # before init_weights reads them.
    shards = shards_by_name(model)
    model.to_empty(device=device)
    restore_shards(model, shards)
    model.init_weights(seed)
    reset_fp8_state(model)  # to_empty left the delayed-scaling buffers uninitialised


def select_ops(model: nn.Module, job: JobConfig) -> None:
    """The operator implementations the model calls (`ops`: reference, fused, compiled)."""
    o = job.ops
    use_ops(model, OpImpls.choose(o.fused, o.compile, o.reference, o.ce_chunk_tokens, o.triton))


def build_parallel_model(job: JobConfig, mesh: ParallelMesh, device: torch.device) -> ParallelModel:
    """The job's model as this rank's part of the layout, without pipeline parallelism."""
    model = build_model(job.model)
    sharding = parallelize(model, job, mesh, family(job.model.family))
    materialize(model, device, job.train.seed)
    select_ops(model, job)
    routed = job.model.n_routed_experts > 0
    par = job.parallel
    mp = fsdp_policy(par.fsdp_param_dtype, par.fsdp_reduce_dtype)
    module = wrap_data_parallel(model, mesh, par.zero, sharding.experts, routed, mp_policy=mp)
    return ParallelModel(
        module,
        model,
        mesh,
        job.parallel.zero,
        sharding.sp_params,
        experts=sharding.experts,
        compiled=torch.compile(module) if job.train.compile else None,
    )
