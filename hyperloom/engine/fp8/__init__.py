"""FP8 hybrid-precision engine: formats, scaling recipes, quantized GEMMs, FP8 linear layers.

Knows nothing of process groups; layers that do (tensor parallel) call `fp8_linear`, MoE
experts call `fp8_grouped_linear`, and the pipeline's split backward hands FP8 layers a
queue for their weight-gradient GEMMs (`defer_weight_grads`). Where the pieces meet the
parallel layouts: tp reduces per-tensor amaxes over the group (`reduce_amax`); dp reduces
delayed scaling's histories over the replicas after each micro-batch; pp converts
each chunk and gathers the delayed-scaling state by global name for checkpoints
(`hyperloom.pipeline.runtime`); ep carries the experts' recipe to each rank's experts,
whose per-expert delayed-scaling state `fp8_state_dict` gathers whole over ep.
"""

from hyperloom.engine.fp8.convert import (
    DEFAULT_KEEP,
    convert_to_fp8,
    fp8_state_dict,
    load_fp8_state_dict,
    reset_fp8_state,
)
from hyperloom.engine.fp8.formats import E4M3, E5M2, Fp8Format, format_for
from hyperloom.engine.fp8.gemm import fp8_gemm, tensor_core_gemm
from hyperloom.engine.fp8.modules import (
    Fp8GroupedLinear,
    Fp8Linear,
    defer_weight_grads,
    fp8_autocast,
    fp8_grouped_linear,
    fp8_linear,
)
from hyperloom.engine.fp8.quantize import Fp8Tensor
from hyperloom.engine.fp8.recipes import (
    RECIPE_NAMES,
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    MXFP8Scaling,
    Recipe,
    RowwiseScaling,
    quantize_for,
    recipe_from_name,
)

__all__ = [
    "DEFAULT_KEEP",
    "E4M3",
    "E5M2",
    "RECIPE_NAMES",
    "BlockwiseScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Format",
    "Fp8GroupedLinear",
    "Fp8Linear",
    "Fp8Tensor",
    "MXFP8Scaling",
    "Recipe",
    "RowwiseScaling",
    "convert_to_fp8",
    "defer_weight_grads",
    "format_for",
    "fp8_autocast",
    "fp8_gemm",
    "fp8_grouped_linear",
    "fp8_linear",
    "fp8_state_dict",
    "load_fp8_state_dict",
    "quantize_for",
    "recipe_from_name",
    "reset_fp8_state",
    "tensor_core_gemm",
]
