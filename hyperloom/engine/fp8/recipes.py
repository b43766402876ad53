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
  once per autocast region, without a global registry of modules. `update="step"` updates
  once per optimizer step instead (below).
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

When delayed scaling updates (`DelayedScaling.update`). TE records each quantization's amax
into slot 0 of the window and, at the exit of the outermost `fp8_autocast`, reduces the amaxes
over `fp8_group` and runs the update (scale from the window, roll by -1, zero slot 0):
`FP8GlobalStateManager.reduce_and_update_fp8_tensors` in transformer_engine/pytorch/fp8.py
(quantization.py in TE 2.x), the C API's
`nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction`. Megatron-LM opens that
context once around a micro-batch's whole TransformerBlock forward for delayed scaling
(megatron/core/transformer/transformer_block.py, `use_outer_fp8_context`), so scales move
per micro-batch: "microbatch" here, the default.
Under pipeline schedules that run a chunk's micro-batches in two places at once (DualPipe's
two copies of a chunk, dp replicas) no history rolling per micro-batch can equal one process:
a copy's next scale would need the other copy's amaxes of the same step. "step" is TE's
autocast region stretched over the optimizer step (its old `DelayedScaling(interval=...)`:
"use scale factor from previous iteration"): every quantization in a step uses the scale set
when the last step ended, amaxes recorded during the step merge by max into slot 0, and
`end_step` -- called once after the step's micro-batches and every reduction of the state
(dp replicas, DualPipe copies) -- computes the next scale and rolls the window once. Max is
exact and order-free, so one process, dp replicas, pp ranks and DualPipe copies hold the
same scales within a step and the same history after it.
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
DELAYED_UPDATES = ("microbatch", "step")  # when delayed scaling moves its scales (docstring)


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
    update: str = "microbatch"  # "microbatch": before each quantization; "step": `end_step`

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
        if self.update not in DELAYED_UPDATES:
            raise ValueError(f"update {self.update!r} is not one of {DELAYED_UPDATES}")


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


def recipe_from_name(
    name: str, high_precision: Iterable[str] = (), delayed_update: str = "microbatch"
) -> Recipe:
    """The recipe for a `precision.fp8` value, with its default settings; the GEMMs named in
    `high_precision` ("fprop", "dgrad", "wgrad") run in high precision
    (`override_linear_precision`); `delayed_update` is delayed scaling's `update`."""
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
    override = tuple(g in high_precision for g in GEMMS)
    if name == "delayed":
        return DelayedScaling(override_linear_precision=override, update=delayed_update)
    if delayed_update != "microbatch":
        raise ValueError(
            f"delayed_update {delayed_update!r} applies to the delayed recipe only, not {name!r}"
        )
    return table[name](override_linear_precision=override)


@torch.no_grad()
def _roll_window(
    history: torch.Tensor, scale: torch.Tensor, recipe: DelayedScaling, fmt_max
) -> torch.Tensor:
    """TE's `amax_and_scale_update` on (..., len, columns) windows and (..., columns) scales:
    the scale from each window, then the window rotated by -1 with slot 0 zeroed (TE's
    order), in place. `fmt_max`: the format's max, a float or one per column. Returns the
    new scales (a new tensor)."""
    amax = history.amax(dim=-2) if recipe.amax_compute_algo == "max" else history[..., 0, :]
    # fmt_max x (1 / amax): what PyTorch makes of `float / tensor` (`Tensor.__rtruediv__`),
    # so a per-column fmt_max tensor scales bit for bit like the float of one column.
    new = amax.reciprocal() * fmt_max / (2.0**recipe.margin)
    # An amax so small that fmt_max / amax overflows FP32 gets FP32's max (TE's third
    # case): an Inf scale would turn the tensor's zeros into NaN (0 x Inf).
    new = torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
    keep = (amax <= 0) | ~torch.isfinite(amax)
    new = torch.where(keep, scale, new)
    scale.copy_(new)
    history.copy_(torch.roll(history, -1, dims=-2))
    history[..., 0, :] = 0.0
    return new


@torch.no_grad()
def end_step(
    recipe: DelayedScaling, history: torch.Tensor, scale: torch.Tensor, fmt_max: torch.Tensor
) -> None:
    """The step-end update of `update="step"` (module docstring): every column's next scale
    from its window, which then rolls once. history (..., len, columns), scale (...,
    columns), `fmt_max` (columns,) the format's max per column (E4M3 or E5M2 by role).
    Call it after the step's reductions of the state, never under `update="microbatch"`."""
    if recipe.update != "step":
        raise ValueError(f"end_step is for update='step', this recipe updates per {recipe.update}")
    _roll_window(history, scale, recipe, fmt_max)


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
        """Scale from the window, then rotate it (TE's order). Returns the new scale. Under
        `update="step"` the scale `end_step` set stays for the whole step: returned as is."""
        c = self.column
        if recipe.update == "step":
            return self.scale[c].clone()  # a copy: `end_step` writes the buffer in place
        h, s = self.history[:, c : c + 1], self.scale[c : c + 1]  # (len, 1), (1,): views
        if self.frozen:  # the same arithmetic on copies
            h, s = h.clone(), s.clone()
        return _roll_window(h, s, recipe, fmt_max)[0]

    @torch.no_grad()
    def record(self, amax: torch.Tensor, merge: bool = False) -> None:
        """Write this quantization's amax into the current slot; `merge` (update="step")
        keeps the slot's max over the step's quantizations instead."""
        if self.frozen:
            return
        slot = self.history[0, self.column]
        self.history[0, self.column] = torch.maximum(slot, amax) if merge else amax


@torch.no_grad()
def observe_empty(recipe: DelayedScaling, role: str, state: DelayedState) -> None:
    """Delayed scaling's turn for an empty tensor (an MoE expert that got no tokens), as TE
    takes it: the scale update runs and amax 0 is recorded. A 0 never raises the window's
    max, and a window of zeros keeps the last scale, so the history stays valid while it
    advances in step with the other experts'."""
    if recompute.replaying():  # the first pass took this turn already
        return
    state.update_scale(recipe, format_for(recipe.fp8_format, role).max)
    state.record(torch.zeros((), device=state.history.device), recipe.update == "step")


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
            amax = reduce_amax(amax) if reduce_amax is not None else amax
            state.record(amax, merge=recipe.update == "step")
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
    "end_step",
    "observe_empty",
    "quantize_for",
    "recipe_from_name",
    "scale_from_amax",
]
