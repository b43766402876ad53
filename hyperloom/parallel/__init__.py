"""Parallelism applied from outside the model: the mesh, tensor/sequence parallel layers,
data parallelism, and layout-free state for checkpoints."""

from __future__ import annotations

import torch

from hyperloom.config import JobConfig
from hyperloom.engine.fp8 import convert_to_fp8, recipe_from_name, reset_fp8_state
from hyperloom.models.registry import build_model, family
from hyperloom.parallel.mesh import ParallelMesh, build_mesh, init_distributed
from hyperloom.parallel.parallelize import (
    ParallelModel,
    apply_tensor_parallel,
    wrap_data_parallel,
)


def parallelize(cfg: JobConfig, mesh: ParallelMesh, device: torch.device) -> ParallelModel:
    """Build the job's model on the meta device, swap in FP8 linears (precision.fp8), apply
    TP/SP, initialise, wrap for DP.

    Initialisation happens after the tensor-parallel swap (each rank allocates only its
    shards) and draws every tensor from the single-device init stream, so all layouts start
    from the same weights.
    """
    model = build_model(cfg.model)
    if cfg.precision.fp8 != "none":
        convert_to_fp8(model, recipe_from_name(cfg.precision.fp8), keep=cfg.precision.fp8_keep)
    sp_params = []
    if mesh.size("tp") > 1:
        sp_params = apply_tensor_parallel(
            model, family(cfg.model.family).tp_plan, mesh.group("tp"), cfg.parallel.sp
        )
    # to_empty makes new Parameter objects when leaving the meta device, so the shard
    # descriptions are carried across by name before init_weights reads them.
    specs = {n: p.shard_spec for n, p in model.named_parameters() if hasattr(p, "shard_spec")}
    model.to_empty(device=device)
    for name, spec in specs.items():
        model.get_parameter(name).shard_spec = spec
    model.init_weights(cfg.train.seed)
    reset_fp8_state(model)  # to_empty left the delayed-scaling buffers uninitialised
    module = wrap_data_parallel(model, mesh, cfg.parallel.zero)
    return ParallelModel(module, model, mesh, cfg.parallel.zero, sp_params)


__all__ = ["ParallelMesh", "ParallelModel", "build_mesh", "init_distributed", "parallelize"]
