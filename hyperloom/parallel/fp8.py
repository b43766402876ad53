"""The FP8 slot of the parallelize recipe: swap in the engine's FP8 linears as `precision`
says, on the meta device, before tensor parallelism, whose layers wrap an FP8 linear and
reduce its amaxes over their group.
"""

from __future__ import annotations

from torch import nn

from hyperloom.config import JobConfig
from hyperloom.engine.fp8 import convert_to_fp8, recipe_from_name


def apply_fp8(model: nn.Module, cfg: JobConfig) -> None:
    """The recipe with its GEMM overrides, the `fp8_keep` patterns, the first/last
    `fp8_bf16_*_layers` blocks kept whole in high precision, and FP8 storage of the saved
    activations (`fp8_activation`), on a whole model or one pipeline chunk. Blocks are
    `layers.N` by global index in every family and in pipeline chunks alike."""
    p8 = cfg.precision
    if p8.fp8 == "none":
        return
    n = cfg.model.n_layers
    ends = [*range(p8.fp8_bf16_first_layers), *range(n - p8.fp8_bf16_last_layers, n)]
    keep = [*p8.fp8_keep, *(f"layers.{i}.*" for i in ends)]
    recipe = recipe_from_name(p8.fp8, p8.fp8_high_precision, p8.fp8_delayed_update)
    convert_to_fp8(model, recipe, keep=keep, fp8_activation=p8.fp8_activation)
