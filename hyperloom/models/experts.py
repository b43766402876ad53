"""A bank of E SwiGLU experts for Mixture-of-Experts layers, family-neutral.

Weights are (experts, out, in); tokens arrive sorted by expert and run as one grouped GEMM
(`torch._grouped_mm`), with a per-expert loop as the fallback. Under `precision.fp8` the
expert GEMMs run through the engine's grouped FP8 linear, each expert with its own scales and
delayed-scaling state (expert dimension first, so expert parallelism splits it like the
weights). It lives outside any family because expert parallelism swaps every bank for one
holding this rank's E / ep experts.

Expert tensor parallelism (`parallel.etp`) splits each expert's hidden width over a group of
ranks (w1, w3 column-parallel, w2 row-parallel) and sets `hidden_split`, an object whose
`enter` hands the bank the group's rows (the rank's own, their gradient summed over the
group; under sequence parallelism every rank's, gathered and regrouped by expert) and whose
`leave` sums the partial outputs over the group: Megatron's column/row pair around the bank.
The model code cannot import `hyperloom.parallel`, which provides it.

FP8 on such a slice quantizes as one process would: `hidden_split.reduce_max` (an all-reduce
MAX over the group) reaches the engine for the operands that are slices of a whole one, as
for the dense tensor-parallel linears: w1 and w3 (column-parallel) their weight and output
gradient, w2 (row-parallel) its input, the hidden activations, and its weight. Per-tensor
recipes (delayed, current) then scale with the whole tensor's amax, and delayed histories
record it, the same on every rank of the group; rowwise reduces the row amaxes where the
contraction dimension is the sliced one; block recipes need slices of whole blocks (checked
where the split is made). The rows entering w1 and w3 are the same on every rank already.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F
from torch import nn

from hyperloom.engine import ops
from hyperloom.engine.fp8 import Recipe
from hyperloom.engine.fp8.modules import Fp8State, active_recipe, fp8_grouped_linear
from hyperloom.engine.ops import OpImpls


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `torch._grouped_mm`'s backward
    rejects the stride-0 gradients that e.g. `.sum()` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward here (probed once per kind).

    Probed on a thread of its own: the first call comes from inside a forward, maybe inside
    an activation-checkpointed region, whose saved-tensor hooks (thread-local) would
    otherwise count the probe's tensors as the region's and find them missing when it is
    recomputed."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type)
    if device_type == "cuda":  # the calling thread's device, not the new thread's default
        device = torch.device("cuda", torch.cuda.current_device())
    result: list[bool] = []
    probe = threading.Thread(target=lambda: result.append(_probe_grouped_mm(device, dtype)))
    probe.start()
    probe.join()
    return bool(result and result[0])


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        # Ones, not random numbers: probing must not move the global RNG (a resumed run's
        # dropout masks would shift).
        x = torch.ones(5, 8, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 8, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([2, 5], device=device, dtype=torch.int32)
        _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs)).sum().backward()
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class Experts(Fp8State, nn.Module):
    """E SwiGLU experts, weights (E, out, in); input tokens sorted by expert."""

    GEMMS = ("w1", "w3", "w2")  # delayed scaling: the column blocks of each expert's state
    # Under `hidden_split`, the FP8 roles whose tensor is a slice of the one-process tensor:
    # w1, w3 split along their output features, w2 along its input features (module doc).
    SPLIT_ROLES = (("weight", "grad_output"), ("weight", "grad_output"), ("input", "weight"))

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.grouped_mm: bool | None = None  # None = use it where it works (grouped_mm_works)
        self.ops = OpImpls()
        self.recipe: Recipe | None = None  # FP8 GEMMs (enable_fp8)
        self.fp8_activation = False
        self.register_buffer("fp8_amax_history", None)  # delayed scaling only (enable_fp8)
        self.register_buffer("fp8_scale", None)
        # expert tensor parallelism: enter(x, counts) -> (rows, counts, undo), leave(out,
        # undo), reduce_max(amax) -> its maximum over the group (FP8)
        self.hidden_split = None

    def enable_fp8(self, recipe: Recipe, fp8_activation: bool = False) -> bool:
        """Run the expert GEMMs in FP8 with `recipe` (called by `convert_to_fp8`). Delayed
        scaling keeps one amax history per expert and GEMM for input, weight and
        grad_output, as TE's grouped linear does: `fp8_amax_history` (E, len, 9) and
        `fp8_scale` (E, 9), columns (w1, w3, w2) x (input, weight, grad_output), expert
        first so that expert parallelism splits them like the weights. Every recipe is
        taken (True)."""
        self._setup_fp8(recipe, len(self.GEMMS), fp8_activation, self.w1.device, self.w1.shape[0])
        return True

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, dim) holding counts[e] consecutive rows for expert e -> (N, dim)."""
        split = self.hidden_split
        if split is None:
            return self._swiglu(x, counts)
        rows, row_counts, undo = split.enter(x, counts)
        return split.leave(self._swiglu(rows, row_counts), undo)

    def _swiglu(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The bank's SwiGLU on this rank's weights (a partial sum under `hidden_split`)."""
        recipe = active_recipe(self.recipe) if self.recipe is not None else None
        if recipe is not None:
            sizes, split = counts.tolist(), self.hidden_split

            def fp8_mm(a: torch.Tensor, w: torch.Tensor, gemm: int) -> torch.Tensor:
                states = [self._states(recipe, gemm, e) for e in range(len(sizes))]
                reduce = None
                if split is not None:
                    reduce = dict.fromkeys(self.SPLIT_ROLES[gemm], split.reduce_max)
                return fp8_grouped_linear(
                    a,
                    w,
                    sizes,
                    recipe,
                    states=states,
                    fp8_activation=self.fp8_activation,
                    reduce_amax=reduce,
                )

            h = ops.swiglu(fp8_mm(x, self.w1, 0), fp8_mm(x, self.w3, 1), self.ops.swiglu)
            return fp8_mm(h, self.w2, 2)  # (N, dim)
        use = self.grouped_mm
        if use is None:
            use = grouped_mm_works(x.device.type, x.dtype)
        if use:
            offs = counts.cumsum(0).to(torch.int32)  # (E,) end row of each expert's tokens

            def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                out = torch._grouped_mm(a, w.to(a.dtype).transpose(-2, -1), offs=offs)
                return _ContiguousGrad.apply(out)

            return mm(ops.swiglu(mm(x, self.w1), mm(x, self.w3), self.ops.swiglu), self.w2)
        outs = []
        for e, xs in enumerate(x.split(counts.tolist())):
            if xs.shape[0]:
                h = ops.swiglu(F.linear(xs, self.w1[e]), F.linear(xs, self.w3[e]), self.ops.swiglu)
                outs.append(F.linear(h, self.w2[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, self.w2.shape[1])
