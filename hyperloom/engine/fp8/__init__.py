"""FP8 hybrid-precision engine: formats, scaling recipes, quantized GEMMs, FP8 linear layers.

Knows nothing of process groups. Tensor parallelism reduces per-tensor amaxes through
`reduce_amax`, MoE experts use `fp8_grouped_linear`, the pipeline's split backward hands FP8
layers a queue for their weight-gradient GEMMs (`defer_weight_grads`), and expert parallelism
gathers per-expert delayed-scaling state whole through `fp8_state_dict`.
"""

from hyperloom.engine.fp8.convert import (
    DEFAULT_KEEP,
    convert_to_fp8,
    end_fp8_step,
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
    "end_fp8_step",
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
