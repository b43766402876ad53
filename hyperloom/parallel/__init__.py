"""Parallelism applied from outside the model: the mesh, tensor/sequence parallel layers,
data parallelism, and layout-free state for checkpoints."""

from __future__ import annotations

import torch
from torch import nn

from hyperloom.config import JobConfig
from hyperloom.engine.fp8 import convert_to_fp8, recipe_from_name, reset_fp8_state
from hyperloom.models.registry import build_model, family
from hyperloom.parallel.expert_parallel import apply_expert_parallel
from hyperloom.parallel.mesh import ParallelMesh, build_mesh, init_distributed
from hyperloom.parallel.parallelize import (
    ParallelModel,
    apply_tensor_parallel,
    restore_shard_attributes,
    shard_attributes,
    wrap_data_parallel,
)


def apply_fp8(model: nn.Module, cfg: JobConfig) -> None:
    """Swap in FP8 linears as `precision` says (a whole model or one pipeline chunk, on the
    meta device, before tp): the recipe with its GEMM overrides, the `fp8_keep` patterns,
    the first/last `fp8_bf16_*_layers` blocks kept whole in high precision, and FP8 storage
    of the saved activations (`fp8_activation`). Blocks are `layers.N` by global index in
    every family and in pipeline chunks alike."""
    p8 = cfg.precision
    if p8.fp8 == "none":
        return
    n = cfg.model.n_layers
    ends = [*range(p8.fp8_bf16_first_layers), *range(n - p8.fp8_bf16_last_layers, n)]
    keep = [*p8.fp8_keep, *(f"layers.{i}.*" for i in ends)]
    recipe = recipe_from_name(p8.fp8, p8.fp8_high_precision)
    convert_to_fp8(model, recipe, keep=keep, fp8_activation=p8.fp8_activation)


def parallelize(cfg: JobConfig, mesh: ParallelMesh, device: torch.device) -> ParallelModel:
    """Build the job's model on the meta device, swap in FP8 linears (precision.fp8), apply
    TP/SP, then EP (each rank keeps its E / ep experts), initialise, wrap for DP.

    Initialisation happens after the tensor-parallel swap (each rank allocates only its
    shards) and draws every tensor from the single-device init stream, so all layouts start
    from the same weights.
    """
    model = build_model(cfg.model)
    apply_fp8(model, cfg)
    sp_params = []
    if mesh.size("tp") > 1:
        sp_params = apply_tensor_parallel(
            model, family(cfg.model.family).tp_plan(cfg.model), mesh.group("tp"), cfg.parallel.sp
        )
    experts = None
    if cfg.parallel.ep > 1:
        ep = cfg.parallel.ep
        ep_group, data_group = mesh.expert_groups(ep)
        experts = apply_expert_parallel(
            model,
            ep_group,
            data_group,
            ep_rank=mesh.rank("dp") % ep,
            ep=ep,
            dp=mesh.size("dp"),
            dispatcher=cfg.parallel.ep_dispatcher,
        )
    # to_empty makes new Parameter objects when leaving the meta device, so the shard
    # descriptions are carried across by name before init_weights reads them.
    attrs = shard_attributes(model)
    model.to_empty(device=device)
    restore_shard_attributes(model, attrs)
    model.init_weights(cfg.train.seed)
    reset_fp8_state(model)  # to_empty left the delayed-scaling buffers uninitialised
    ignore = experts.names if experts is not None else []
    routed = cfg.model.n_routed_experts > 0
    module = wrap_data_parallel(model, mesh, cfg.parallel.zero, ignore, routed)
    return ParallelModel(module, model, mesh, cfg.parallel.zero, sp_params, experts=experts)


__all__ = ["ParallelMesh", "ParallelModel", "build_mesh", "init_distributed", "parallelize"]
