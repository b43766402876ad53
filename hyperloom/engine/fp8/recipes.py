"""FP8 scaling recipes: how each GEMM operand gets its scale, and what that costs.

An FP8 value has 2-3 mantissa bits and a narrow range (E4M3: about 2^-9 .. 448), so a tensor
is multiplied by a scale mapping its amax near the top of the range before the cast, and the
GEMM output by 1 / scale. Recipes differ in which amax sets the scale and how many elements
share one; that trades memory reads, outlier robustness and kernel simplicity.

- **Delayed** (TransformerEngine `DelayedScaling`; arXiv 2209.05433): one scale per tensor
  from a history of past amaxes, fp8_max / amax / 2^margin. One read of the tensor, at the
  price of clipping when it grows faster than the history predicts. TE's bookkeeping is kept
  exactly (window roll, zero/non-finite amax keeps the old scale); we update right before
  each quantization instead of at `fp8_autocast` exit: the same sequence when a module runs
  once per autocast region, without a global registry of modules.
- **Current** (TE `Float8CurrentScaling`): one scale per tensor from its own amax; two reads,
  never stale. Per-tensor recipes let one outlier squeeze every other value.
- **Rowwise** (torchao float8 "rowwise"): one scale per row along the contraction dimension;
  backward GEMMs re-quantize a transposed copy. Scales are rounded down to powers of two, so
  a last-bit change of a row's amax almost never moves the scale -- exact scales made tp = 2
  drift from one process (docs/fp8.md).
- **Blockwise** (DeepSeek-V3, arXiv 2412.19437 §3.3; TE `Float8BlockScaling`; DeepGEMM):
  1 x 128 tiles for activations and gradients, 128 x 128 blocks for weights, so E4M3 suffices
  for gradients too. Tensor cores accumulate FP8 products in about 14 bits (DeepSeek, H800),
  so partial sums are promoted to FP32 every 128 elements. The weight block is symmetric and
  its quantization is reused transposed; activation tiles are re-tiled to 128 x 1 for wgrad.
- **MXFP8** (OCP Microscaling v1.0; TE `MXFP8BlockScaling`): 1 x 32 blocks with an E8M0
  power-of-two scale, hardware-native on Blackwell. The exponent is ceil(log2(amax / 448)) as
  in TE (never saturates); the OCP rounding floor(log2 amax) - 8 is available.

Every recipe takes TE's `override_linear_precision` = (fprop, dgrad, wgrad): a GEMM marked
True runs in the autocast dtype (Megatron's `--no-fp8-wgrad` is (False, False, True)). How
much each GEMM contributes to the gradient error and the loss is measured in docs/fp8.md.

Communication: under tensor parallelism delayed and current scaling reduce a sharded tensor's
amax, and rowwise the row amaxes of an operand whose contraction dimension is sharded (one
all-reduce MAX each). Under data parallelism delayed scaling's histories are reduced (max)
after each micro-batch (`ParallelModel.sync_fp8_replicas`), as TE reduces over its
`fp8_group`, so every rank scales as one process seeing all ranks' micro-batches would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hyperloom.engine import recompute
from hyperloom.engine.fp8.formats import check_format_choice, format_for
from hyperloom.engine.fp8.quantize import (
    FP32_MAX,
    Fp8Tensor,
    abs_max,
    quantize_blocks,
    quantize_current,
    quantize_mx,
    scale_from_amax,
)

RECIPE_NAMES = ("delayed", "current", "rowwise", "blockwise", "mxfp8")
AMAX_ALGOS = ("max", "most_recent")


GEMMS = ("fprop", "dgrad", "wgrad")


@dataclass(frozen=True)
class _RecipeBase:
    fp8_format: str = "e4m3"  # "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3"
    # TE's `override_linear_precision`: (fprop, dgrad, wgrad), True runs that GEMM of every
    # FP8 linear in high precision (the autocast dtype, as a BF16 layer would). Megatron's
    # `--no-fp8-wgrad` is (False, False, True). Also the tool that splits an FP8 run's error
    # between the forward and the two backward GEMMs (benchmarks/fp8_gradient_fidelity.py).
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)

    def __post_init__(self) -> None:
        check_format_choice(self.fp8_format)
        o = tuple(self.override_linear_precision)  # a list from a config file hashes as a tuple
        object.__setattr__(self, "override_linear_precision", o)
        if len(o) != 3 or not all(isinstance(v, bool) for v in o):
            raise ValueError(
                f"override_linear_precision must be three booleans {GEMMS}, got {o!r}"
            )
        if all(o):
            raise ValueError(
                "override_linear_precision=(True, True, True) leaves no GEMM in FP8; "
                "turn FP8 off instead"
            )

    def high_precision(self, gemm: str) -> bool:
        """Whether `gemm` ("fprop", "dgrad", "wgrad") runs in high precision."""
        return self.override_linear_precision[GEMMS.index(gemm)]


@dataclass(frozen=True)
class DelayedScaling(_RecipeBase):
    """Per-tensor scale from a window of past amaxes (TE defaults)."""

    fp8_format: str = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0

    name = "delayed"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(
                f"amax_compute_algo {self.amax_compute_algo!r} is not one of {AMAX_ALGOS}"
            )
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0 (powers of two of headroom), got {self.margin}")


@dataclass(frozen=True)
class CurrentScaling(_RecipeBase):
    """Per-tensor scale from the tensor's own amax."""

    fp8_format: str = "hybrid"
    amax_epsilon: float = 0.0
    power_2_scale: bool = False

    name = "current"


@dataclass(frozen=True)
class RowwiseScaling(CurrentScaling):
    """One scale per row along the contraction dimension (current amax of each row), rounded
    down to a power of two as torchao's rowwise recipe does (`round_scales_to_power_of_2`)."""

    fp8_format: str = "e4m3"
    power_2_scale: bool = True

    name = "rowwise"


@dataclass(frozen=True)
class BlockwiseScaling(_RecipeBase):
    """DeepSeek-V3 1 x 128 activation/gradient tiles, 128 x 128 weight blocks."""

    block: int = 128
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    name = "blockwise"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")


@dataclass(frozen=True)
class MXFP8Scaling(_RecipeBase):
    """OCP MX: 1 x 32 blocks with E8M0 scales."""

    block: int = 32
    scale_rounding: str = "ceil"

    name = "mxfp8"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scale_rounding not in ("ceil", "floor"):
            raise ValueError(
                f"scale_rounding {self.scale_rounding!r} is not one of 'ceil' (TE), 'floor' (OCP)"
            )


Recipe = DelayedScaling | CurrentScaling | RowwiseScaling | BlockwiseScaling | MXFP8Scaling


def recipe_from_name(name: str, high_precision: Iterable[str] = ()) -> Recipe:
    """The recipe for a `precision.fp8` value, with its default settings; the GEMMs named in
    `high_precision` ("fprop", "dgrad", "wgrad") run in high precision
    (`override_linear_precision`)."""
    table = {
        "delayed": DelayedScaling,
        "current": CurrentScaling,
        "rowwise": RowwiseScaling,
        "blockwise": BlockwiseScaling,
        "mxfp8": MXFP8Scaling,
    }
    if name not in table:
        raise ValueError(f"fp8 recipe {name!r} is not one of {RECIPE_NAMES}")
    high_precision = set(high_precision)
    if high_precision - set(GEMMS):
        raise ValueError(f"unknown GEMMs {sorted(high_precision - set(GEMMS))}; known: {GEMMS}")
    return table[name](override_linear_precision=tuple(g in high_precision for g in GEMMS))


class DelayedState:
    """A view of one tensor's amax history (one column of a module's history buffer) and
    its scale, updated in place (the buffers are module state, so checkpoints carry them).

    `frozen` (a module in eval mode: validation, generation) quantizes with the scale the
    next training quantization would use and changes nothing, so evaluating never alters
    the training run (its scales, or a checkpoint's)."""

    def __init__(
        self, history: torch.Tensor, scale: torch.Tensor, column: int, frozen: bool = False
    ):
        self.history, self.scale, self.column, self.frozen = history, scale, column, frozen

    @torch.no_grad()
    def update_scale(self, recipe: DelayedScaling, fmt_max: float) -> torch.Tensor:
        """Scale from the window, then rotate it (TE's order). Returns the new scale."""
        h = self.history[:, self.column]  # (len,), a view
        amax = h.max() if recipe.amax_compute_algo == "max" else h[0]
        new = fmt_max / amax / (2.0**recipe.margin)
        # An amax so small that fmt_max / amax overflows FP32 gets FP32's max (TE's third
        # case): an Inf scale would turn the tensor's zeros into NaN (0 x Inf).
        new = torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
        keep = (amax <= 0) | ~torch.isfinite(amax)
        new = torch.where(keep, self.scale[self.column], new)
        if self.frozen:
            return new
        self.scale[self.column] = new
        h.copy_(torch.roll(h, -1))
        h[0] = 0.0
        return new

    @torch.no_grad()
    def record(self, amax: torch.Tensor) -> None:
        if not self.frozen:
            self.history[0, self.column] = amax


@torch.no_grad()
def observe_empty(recipe: DelayedScaling, role: str, state: DelayedState) -> None:
    """Delayed scaling's turn for an empty tensor (an MoE expert that got no tokens), as TE
    takes it: the scale update runs and amax 0 is recorded. A 0 never raises the window's
    max, and a window of zeros keeps the last scale, so the history stays valid while it
    advances in step with the other experts'."""
    if recompute.replaying():  # the first pass took this turn already
        return
    state.update_scale(recipe, format_for(recipe.fp8_format, role).max)
    state.record(torch.zeros((), device=state.history.device))


def quantize_for(
    x: torch.Tensor,
    recipe: Recipe,
    role: str,
    state: DelayedState | None = None,
    reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Fp8Tensor:
    """Quantize a 2-D (rows, K) operand for `role` ("input", "weight", "grad_output") with
    `recipe`; K, the last dimension, is the GEMM's contraction dimension.

    `reduce_amax`: x is one shard of a larger tensor, and this callback returns the
    elementwise maximum of an amax tensor over all shards (e.g. an all-reduce MAX over a
    tensor-parallel group), so every shard gets the whole tensor's scale -- and delayed
    scaling records the whole tensor's amax, keeping histories identical across shards.
    Rowwise: x is a slice of K (the contraction dimension) and the callback reduces the
    (rows, 1) row amaxes, so each row gets the scale of its whole row. Blockwise and MXFP8
    ignore it (their blocks must not straddle shards)."""
    fmt = format_for(recipe.fp8_format, role)
    rows, cols = x.shape
    if isinstance(recipe, DelayedScaling):
        if state is None:
            raise ValueError("delayed scaling needs the tensor's DelayedState (amax history)")
        replay = recompute.current()
        if replay is None:
            scale = state.update_scale(recipe, fmt.max)
        else:  # a checkpointed region: a recompute quantizes with the first pass's scale
            scale = replay.scale(lambda: state.update_scale(recipe, fmt.max))
        q = quantize_blocks(x, (rows, cols), fmt, scale.view(1, 1))
        if replay is None or not replay.replaying:  # a recompute records nothing
            amax = abs_max(x)
            state.record(reduce_amax(amax) if reduce_amax is not None else amax)
        return q
    if isinstance(recipe, RowwiseScaling):
        if reduce_amax is None:
            return quantize_current(x, (1, cols), fmt, recipe.amax_epsilon, recipe.power_2_scale)
        # x holds a slice of K: each row's amax is the max over every shard's slice of it.
        amax = reduce_amax(x.detach().abs().amax(dim=1, keepdim=True).float())  # (rows, 1)
        scale = scale_from_amax(amax, fmt.max, recipe.amax_epsilon, recipe.power_2_scale)
        return quantize_blocks(x, (1, cols), fmt, scale, recipe.power_2_scale)
    if isinstance(recipe, CurrentScaling):
        amax = abs_max(x).view(1, 1)
        if reduce_amax is not None:
            amax = reduce_amax(amax)
        scale = scale_from_amax(amax, fmt.max, recipe.amax_epsilon, recipe.power_2_scale)
        return quantize_blocks(x, (rows, cols), fmt, scale, recipe.power_2_scale)
    if isinstance(recipe, BlockwiseScaling):
        b = recipe.block
        block = (b, b) if role == "weight" else (1, b)
        return quantize_current(x, block, fmt, recipe.amax_epsilon, recipe.power_2_scale)
    if isinstance(recipe, MXFP8Scaling):
        return quantize_mx(x, recipe.block, fmt, recipe.scale_rounding)
    raise TypeError(f"not an FP8 recipe: {recipe!r}")


__all__ = [
    "BlockwiseScaling",
    "CurrentScaling",
    "DelayedScaling",
    "DelayedState",
    "MXFP8Scaling",
    "Recipe",
    "RowwiseScaling",
    "observe_empty",
    "quantize_for",
    "recipe_from_name",
    "scale_from_amax",
]
