"""FP8 linear layers: forward, data-gradient and weight-gradient GEMMs in FP8.

For y = x Wᵀ (x (M, K), W (N, K)):

    fprop  y  = x  Wᵀ     over K
    dgrad  dx = dy W      over N
    wgrad  dW = dyᵀ x     over M

Each operand is quantized along its contraction dimension (`recipes.quantize_for`). A
quantized tensor whose scales survive transposition (per tensor, 128 x 128 blocks) is reused
transposed; otherwise the transposed operand is quantized again from the high-precision
tensor, as TransformerEngine and torchao do. GEMMs accumulate in FP32 and round once to the
dtype a BF16 layer's GEMMs produce (the autocast dtype), so outputs match the BF16 baseline's
dtypes; a bias is added in FP32 before that rounding.

`fp8_activation=True` saves the FP8 copy of the input for backward (DeepSeek-V3 §3.3.3);
recipes whose activation scales do not transpose re-tile it for wgrad, a second rounding.

Delayed scaling keeps amax histories and scales in buffers (columns input, weight,
grad_output per GEMM; experts first for MoE, so expert parallelism splits them like the
weights), so checkpoints carry them. Every training quantization updates that state once, in
GEMM order, so each micro-batch advances the history, as TE's one update per `fp8_autocast`
region does; eval mode reads the state without changing it. Under `update="step"` the
quantizations only record (max into the current slot) and `end_fp8_step` moves every
column's scale and window once per optimizer step (hyperloom.engine.fp8.recipes).

Split backward (Zero Bubble, DualPipe): under `defer_weight_grads(put)` a layer hands its
wgrad GEMM to `put` instead of running it, from the same quantized grad_output and saved
activation, so the numbers equal an undeferred backward. An expert that is a slice of a
stacked weight gets its gradient in B, like the pipeline's BF16 path.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyperloom.engine.fp8.formats import ROLES, format_for
from hyperloom.engine.fp8.gemm import fp8_gemm
from hyperloom.engine.fp8.recipes import (
    GEMMS,
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    DelayedState,
    MXFP8Scaling,
    Recipe,
    RowwiseScaling,
    end_step,
    observe_empty,
)
from hyperloom.engine.fp8.recipes import quantize_for as _q

# --------------------------------------------------------------------------- the context


@dataclass(frozen=True)
class _Autocast:
    enabled: bool
    recipe: Recipe | None


_ACTIVE: contextvars.ContextVar[_Autocast | None] = contextvars.ContextVar(
    "hyperloom_fp8_autocast", default=None
)


@contextlib.contextmanager
def fp8_autocast(recipe: Recipe | None = None, enabled: bool = True):
    """Inside, FP8 modules use `recipe` (None: each module's own) or, with enabled=False,
    run their GEMMs in high precision (plain `F.linear`)."""
    token = _ACTIVE.set(_Autocast(enabled, recipe))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# Where weight-gradient work goes instead of running in backward: a callable that queues a
# job and returns True, or returns False to have it run now (see split backward above).
_DEFER: contextvars.ContextVar[Callable[[Callable[[], None]], bool] | None] = (
    contextvars.ContextVar("hyperloom_fp8_defer_wgrad", default=None)
)


@contextlib.contextmanager
def defer_weight_grads(put: Callable[[Callable[[], None]], bool]):
    """FP8 layers run forward inside hand their weight-gradient GEMMs to `put` in backward
    (captured at forward time: autograd may run backward on another thread)."""
    token = _DEFER.set(put)
    try:
        yield
    finally:
        _DEFER.reset(token)


def active_recipe(default: Recipe) -> Recipe | None:
    """The recipe a module should use now, or None when FP8 is switched off."""
    ctx = _ACTIVE.get()
    if ctx is None:
        return default
    if not ctx.enabled:
        return None
    return ctx.recipe or default


# --------------------------------------------------------------------------- autograd


@dataclass
class _Plan:
    recipe: Recipe
    states: dict[str, DelayedState | None]
    fp8_activation: bool
    out_dtype: torch.dtype
    reduce_amax: dict[str, Callable[[torch.Tensor], torch.Tensor] | None]
    defer: Callable[[Callable[[], None]], bool] | None = None


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


def _hp_gemm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ bᵀ in `dtype` (the autocast dtype: what a BF16 layer's GEMM does), for the GEMMs
    `override_linear_precision` keeps out of FP8."""
    return a.to(dtype) @ b.to(dtype).t()


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: _Plan):
        with _no_autocast(x.device):
            x2d = x.reshape(-1, x.shape[-1])  # (M, K)
            red, recipe = plan.reduce_amax, plan.recipe
            hp = dict(zip(GEMMS, recipe.override_linear_precision, strict=True))
            # Rowwise scales span K: reduced only when K is sharded (the input is then a
            # shard too), never for a weight sharded along N (column-parallel).
            k_whole = isinstance(recipe, RowwiseScaling) and red["input"] is None
            red_w = None if k_whole else red["weight"]
            # Quantized here whenever an FP8 GEMM uses them (also under an override of the
            # forward GEMM), so delayed scaling records its amaxes at the usual point.
            qx = qw = None
            if not (hp["fprop"] and hp["wgrad"]):
                qx = _q(x2d, recipe, "input", plan.states["input"], red["input"])
            if not (hp["fprop"] and hp["dgrad"]):
                qw = _q(weight, recipe, "weight", plan.states["weight"], red_w)
            if hp["fprop"]:
                y = _hp_gemm(x2d, weight, plan.out_dtype)
                y = y if bias is None else y.float() + bias.float()
            elif bias is None:
                y = fp8_gemm(qx, qw, plan.out_dtype)  # (M, N)
            else:
                y = fp8_gemm(qx, qw) + bias.float()
        ctx.plan, ctx.qw, ctx.x_shape, ctx.x_dtype = plan, qw, x.shape, x.dtype
        ctx.has_bias = bias is not None
        leaves = weight.is_leaf and (bias is None or bias.is_leaf)
        ctx.params = (weight, bias) if plan.defer is not None and leaves else None
        # A high-precision weight-gradient GEMM wants the activation as it came (unless FP8
        # storage of activations was asked for: then from the FP8 copy).
        keep_fp8 = qx is not None and (
            plan.fp8_activation or (qx.transposable and not hp["wgrad"])
        )
        ctx.qx = qx if keep_fp8 else None
        ctx.save_for_backward(weight, None if keep_fp8 else x2d)
        return y.to(plan.out_dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        weight, x2d = ctx.saved_tensors
        plan, qw, qx = ctx.plan, ctx.qw, ctx.qx
        dx = dw = db = None
        recipe, w_dtype = plan.recipe, weight.dtype
        hp_dgrad, hp_wgrad = recipe.high_precision("dgrad"), recipe.high_precision("wgrad")
        with _no_autocast(dy.device):
            dy2d = dy.reshape(-1, dy.shape[-1])  # (M, N)
            red = plan.reduce_amax["grad_output"]
            qdy = None
            if not (hp_dgrad and hp_wgrad):
                qdy = _q(dy2d, recipe, "grad_output", plan.states["grad_output"], red)
            if ctx.needs_input_grad[0] and hp_dgrad:
                dx = _hp_gemm(dy2d, weight.t(), plan.out_dtype)
                dx = dx.to(ctx.x_dtype).view(ctx.x_shape)
            elif ctx.needs_input_grad[0]:  # Wᵀ along N: sharded with grad_output (rowwise)
                wt = qw.t() if qw.transposable else _q(weight.t(), recipe, "weight", None, red)
                dx = fp8_gemm(qdy, wt, plan.out_dtype).to(ctx.x_dtype).view(ctx.x_shape)
        want_w = ctx.needs_input_grad[1]
        want_b = ctx.has_bias and ctx.needs_input_grad[2]

        def weight_grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            gw = gb = None
            with _no_autocast(dy2d.device):
                if want_w and hp_wgrad:
                    x_hp = qx.dequantize() if qx is not None else x2d
                    gw = _hp_gemm(dy2d.t(), x_hp.t(), plan.out_dtype).to(w_dtype)  # (N, K)
                elif want_w:
                    dyt = qdy.t() if qdy.transposable else _q(dy2d.t(), recipe, "grad_output")
                    if qx is not None and qx.transposable:
                        xt = qx.t()
                    else:  # re-tile along M, from the FP8 copy when that is what was kept
                        x_hp = qx.dequantize() if qx is not None else x2d
                        xt = _q(x_hp.t(), recipe, "input")
                    gw = fp8_gemm(dyt, xt, plan.out_dtype).to(w_dtype)  # (N, K)
                if want_b:
                    gb = dy2d.float().sum(0).to(w_dtype)
            return gw, gb

        params = ctx.params
        if params is not None and (want_w or want_b):

            def fp8_wgrad() -> None:
                for p, g in zip(params, weight_grads(), strict=True):
                    if g is not None:
                        p.grad = g.to(p.dtype) if p.grad is None else p.grad.add_(g)

            if plan.defer(fp8_wgrad):
                return dx, None, None, None
        dw, db = weight_grads()
        return dx, dw, db, None


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _checked_states(
    recipe: Recipe, states: dict[str, DelayedState | None] | None
) -> dict[str, DelayedState | None]:
    states = states or dict.fromkeys(ROLES)
    if isinstance(recipe, DelayedScaling) and any(states[r] is None for r in ROLES):
        raise ValueError(
            "delayed scaling needs amax-history state for input, weight and grad_output; "
            "build the layer with a DelayedScaling recipe (convert_to_fp8) to allocate it"
        )
    return states


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    states: dict[str, DelayedState | None] | None = None,
    fp8_activation: bool = False,
    reduce_amax: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> torch.Tensor:
    """y = x Wᵀ + b with all three GEMMs in FP8 -- the hook other linear layers (e.g.
    tensor-parallel ones, on their weight shard) call instead of `F.linear`.

    `states` maps each role to its `DelayedState` (delayed scaling only). `reduce_amax` maps
    the roles whose tensor here is a shard of a larger one (tensor parallelism: weight and
    grad_output of a column-parallel layer, input and weight of a row-parallel one) to a
    callback returning the max of an amax over all shards; per-tensor recipes (delayed,
    current) then use the whole tensor's scale on every shard. Rowwise reduces row amaxes
    where a GEMM's contraction dimension is sharded: K when "input" is given (row-parallel:
    x and W in forward), N when "grad_output" is given (column-parallel: dy and Wᵀ in the
    data-gradient GEMM); the weight-gradient GEMM contracts over the tokens, never sharded
    here. Blockwise and MXFP8 scales are local to their blocks and need no reduction when
    shards are whole blocks (the caller checks).
    """
    states = _checked_states(recipe, states)
    reduce_amax = {role: (reduce_amax or {}).get(role) for role in ROLES}
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"fp8_linear: input has {x.shape[-1]} features, weight {tuple(weight.shape)} "
            f"expects {weight.shape[-1]}"
        )
    plan = _Plan(recipe, states, fp8_activation, _out_dtype(x), reduce_amax, _DEFER.get())
    return _Fp8LinearFn.apply(x, weight, bias, plan)


# --------------------------------------------------------------------------- modules


class _Fp8State:
    """Recipe, delayed-scaling buffers and their bookkeeping, shared by the FP8 modules."""

    fp8_amax_history: torch.Tensor | None
    fp8_scale: torch.Tensor | None

    def _setup_fp8(
        self,
        recipe: Recipe,
        n_gemms: int,
        fp8_activation: bool,
        device,
        groups: int | None = None,
    ) -> None:
        """Delayed scaling: history (len, 3 * n_gemms) and scale (3 * n_gemms,), or with
        `groups` (MoE experts split over ranks along it) (groups, len, 3 * n_gemms) and
        (groups, 3 * n_gemms)."""
        self.recipe, self.fp8_activation, self.n_gemms = recipe, fp8_activation, n_gemms
        if isinstance(recipe, DelayedScaling):
            lead, n = () if groups is None else (groups,), len(ROLES) * n_gemms
            hist = torch.zeros(*lead, recipe.amax_history_len, n, device=device)
            self.register_buffer("fp8_amax_history", hist)
            self.register_buffer("fp8_scale", torch.ones(*lead, n, device=device))
        else:
            self.fp8_amax_history = self.fp8_scale = None

    @torch.no_grad()
    def reset_fp8_state(self) -> None:
        """Empty histories, unit scales (call after `to_empty` materialises the module)."""
        if self.fp8_amax_history is not None:
            self.fp8_amax_history.zero_()
            self.fp8_scale.fill_(1.0)

    @torch.no_grad()
    def end_fp8_step(self) -> None:
        """Delayed scaling with `update="step"`: the optimizer step's one scale update and
        window roll, for every GEMM's input, weight and grad_output column (and every
        expert's); nothing for other recipes. Call after the step's reductions."""
        recipe = self.recipe
        if not isinstance(recipe, DelayedScaling) or recipe.update != "step":
            return
        if self.fp8_amax_history is None:
            return
        n = self.fp8_scale.shape[-1]  # columns: (input, weight, grad_output) per GEMM
        maxes = [format_for(recipe.fp8_format, ROLES[c % len(ROLES)]).max for c in range(n)]
        fmt_max = torch.tensor(maxes, device=self.fp8_scale.device)
        end_step(recipe, self.fp8_amax_history, self.fp8_scale, fmt_max)

    def _states(
        self, recipe: Recipe, gemm: int = 0, group: int | None = None
    ) -> dict[str, DelayedState | None]:
        """The input, weight and grad_output states of GEMM `gemm` (of expert `group` when
        the buffers have a group dimension)."""
        if not isinstance(recipe, DelayedScaling) or self.fp8_amax_history is None:
            return dict.fromkeys(ROLES)
        hist, scale = self.fp8_amax_history, self.fp8_scale
        if group is not None:
            hist, scale = hist[group], scale[group]  # (len, 3 * gemms), (3 * gemms,): views
        base, frozen = len(ROLES) * gemm, not self.training  # eval leaves the state alone
        return {role: DelayedState(hist, scale, base + i, frozen) for i, role in enumerate(ROLES)}

    # Checkpoints hold the scaling state whole; a layer whose buffers are this rank's piece
    # of it (expert parallelism) overrides these two.
    def fp8_whole(self, buf: torch.Tensor) -> torch.Tensor:
        """The whole-model value of scaling buffer `buf` (a collective where it is split)."""
        return buf

    def fp8_piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole scaling buffer read from a checkpoint."""
        return whole

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        # A state dict from a plain nn.Linear (or a stateless recipe) has no scaling state:
        # keep this module's own instead of failing a strict load.
        super()._load_from_state_dict(state_dict, prefix, *args)
        missing = args[2]  # (local_metadata, strict, missing_keys, unexpected_keys, errors)
        for key in (f"{prefix}fp8_amax_history", f"{prefix}fp8_scale"):
            if key in missing:
                missing.remove(key)


Fp8State = _Fp8State  # the mixin other FP8-capable layers (tensor-parallel linears) inherit


class Fp8Linear(_Fp8State, nn.Linear):
    """Drop-in `nn.Linear` (same parameters and names) with FP8 GEMMs."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        recipe: Recipe | None = None,
        fp8_activation: bool = False,
    ):
        nn.Linear.__init__(self, in_features, out_features, bias, device, dtype)
        self._setup_fp8(recipe or CurrentScaling(), 1, fp8_activation, self.weight.device)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: Recipe, fp8_activation: bool = False
    ) -> Fp8Linear:
        """Wrap `linear`'s own Parameter objects (works on the meta device)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            recipe=recipe,
            fp8_activation=fp8_activation,
        )
        new.weight, new.bias = linear.weight, linear.bias
        if new.fp8_amax_history is not None:  # move the (meta) scaling state to the weights
            dev = linear.weight.device
            new.fp8_amax_history = torch.zeros_like(new.fp8_amax_history, device=dev)
            new.fp8_scale = torch.ones_like(new.fp8_scale, device=dev)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = active_recipe(self.recipe)
        if recipe is None:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(
            x, self.weight, self.bias, recipe, self._states(recipe), self.fp8_activation
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


class Fp8GroupedLinear(_Fp8State, nn.Module):
    """Per-group linears for MoE experts: tokens sorted by group, weight (groups, out, in).

    Runs one FP8 linear per non-empty group (the fallback of a grouped GEMM such as
    DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous`); each group has its own scaling state.
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device=None,
        dtype=None,
        recipe: Recipe | None = None,
        fp8_activation: bool = False,
    ):
        super().__init__()
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.zeros(num_groups, out_features, **kw)) if bias else None
        bound = in_features**-0.5  # nn.Linear's default uniform init, per expert
        if self.weight.device.type != "meta":
            nn.init.uniform_(self.weight, -bound, bound)
        self._setup_fp8(recipe or CurrentScaling(), num_groups, fp8_activation, device)

    def forward(self, x: torch.Tensor, group_sizes: list[int] | torch.Tensor) -> torch.Tensor:
        """x (tokens, in) with the tokens of group g in the g-th run of `group_sizes[g]`
        rows -> (tokens, out)."""
        recipe = active_recipe(self.recipe)
        states = None if recipe is None else [self._states(recipe, g) for g in range(self.n_gemms)]
        return fp8_grouped_linear(
            x, self.weight, group_sizes, recipe, self.bias, states, self.fp8_activation
        )


class _IdleGroupFn(torch.autograd.Function):
    """A group with no rows under delayed scaling, as TE's grouped linear treats an empty
    split: its weight is quantized as every forward quantizes every expert's (amax
    recorded), its empty input and, in backward, its empty grad_output record amax 0
    (`observe_empty`). Recording 0 rather than skipping keeps each expert's window the same
    micro-batches as its neighbours' (and the same as TE's); it cannot corrupt the history,
    since 0 never wins "max" and an all-zero window keeps the last scale. Output: (0, out),
    in the graph only so that backward takes grad_output's turn at the time the others do."""

    @staticmethod
    def forward(ctx, weight, recipe, states, out_dtype, reduce_weight=None):
        with torch.no_grad():
            _q(weight.detach(), recipe, "weight", states["weight"], reduce_weight)
        observe_empty(recipe, "input", states["input"])
        ctx.recipe, ctx.state = recipe, states["grad_output"]
        return weight.new_zeros(0, weight.shape[0], dtype=out_dtype)

    @staticmethod
    def backward(ctx, dy):
        observe_empty(ctx.recipe, "grad_output", ctx.state)
        return None, None, None, None, None


def _grouped_path(recipe: Recipe | None, bias, fp8_activation: bool) -> bool:
    """Whether `fp8_grouped_linear` can run all groups as one grouped GEMM per pass.

    The recipes whose activation scales are per token (1 x 128 tiles, 1 x 32 MX blocks, one
    per row), so that quantizing every group's tokens at once is quantizing each group's,
    and whose scales are powers of two, so that the dequantized operands are exact in the
    GEMM's dtype: blockwise, MXFP8, rowwise (power-of-two by default). Per-tensor recipes
    (current, delayed) take one scale per expert and stay on the per-group path, as does a
    recipe that keeps some GEMM in high precision (`override_linear_precision`)."""
    pow2 = isinstance(recipe, MXFP8Scaling) or (
        isinstance(recipe, (BlockwiseScaling, RowwiseScaling)) and recipe.power_2_scale
    )
    return (
        pow2
        and not any(recipe.override_linear_precision)
        and bias is None
        and not fp8_activation
    )


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs on this kind of device for `dtype` (probed once per
    kind: CUDA builds have it only for recent GPUs). Ones, not random numbers: probing must
    not move the global RNG."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(4, 16, device=device_type, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
        offs = torch.tensor([2, 4], device=device_type, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _expert_weights(
    w: torch.Tensor, recipe: Recipe, dtype: torch.dtype, reduce_amax=None
) -> torch.Tensor:
    """Every expert's (rows, K) matrix of `w` (E, rows, K) quantized as its own weight and
    dequantized to `dtype`, in one quantization: the experts are stacked with their rows
    padded to a whole number of scale blocks, so no block straddles two experts (zero rows
    raise no amax), then cropped -- to the whole block even when an expert has fewer rows,
    since one 128 x 128 block over two experts' rows would give them one scale.
    `reduce_amax`: K is sharded (rowwise, see `quantize_for`)."""
    e, rows, k = w.shape
    br = recipe.block if isinstance(recipe, BlockwiseScaling) else 1
    pad = -rows % br
    stacked = F.pad(w, (0, 0, 0, pad)) if pad else w
    q = _q(stacked.reshape(e * (rows + pad), k), recipe, "weight", None, reduce_amax)
    return q.dequantize(dtype).view(e, rows + pad, k)[:, :rows]


class _Fp8GroupedFn(torch.autograd.Function):
    """All groups of `fp8_grouped_linear` at once (see `_grouped_path`): per pass one
    quantization of the tokens, one of the stacked expert weights and one grouped GEMM
    (`torch._grouped_mm` over the dequantized operands: BF16 in, FP32 accumulation, one
    rounding, as DeepGEMM's grouped contiguous FP8 GEMM returns BF16), instead of a
    quantization and a GEMM per expert. The weight gradient contracts over each group's own
    tokens, so its operands are re-tiled group by group, as the per-group path does.
    Same quantized values as the per-group path; only the GEMMs' FP32 summation order may
    differ. `reduce_amax` as in `fp8_linear`: rowwise reduces the row amaxes of the forward
    operands when "input" is given (K sharded) and of the data-gradient operands when
    "grad_output" is (N sharded); the block recipes need none."""

    @staticmethod
    def forward(ctx, x, weight, sizes: list[int], recipe: Recipe, out_dtype, gemm_dtype, red):
        with _no_autocast(x.device):
            offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
            red_k = red["input"]
            xq = _q(x, recipe, "input", None, red_k).dequantize(gemm_dtype)  # (M, K)
            w = _expert_weights(weight, recipe, gemm_dtype, red_k)  # (E, N, K)
            y = torch._grouped_mm(xq, w.transpose(-2, -1), offs=offs)  # (M, N)
        ctx.save_for_backward(x, weight, offs)
        ctx.sizes, ctx.recipe, ctx.gemm_dtype = sizes, recipe, gemm_dtype
        ctx.red_n = red["grad_output"]
        ctx.w_fwd = w if isinstance(recipe, BlockwiseScaling) else None  # 128 x 128: transposes
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offs = ctx.saved_tensors
        recipe, dt = ctx.recipe, ctx.gemm_dtype
        dx = dw = None
        with _no_autocast(dy.device):
            dq = _q(dy, recipe, "grad_output", None, ctx.red_n)  # (M, N), tiles along N
            if ctx.needs_input_grad[0]:
                wt = ctx.w_fwd
                if wt is None:  # scales along K do not survive the transpose: along N now
                    wt_n = weight.transpose(-2, -1)
                    wt = _expert_weights(wt_n, recipe, dt, ctx.red_n).transpose(-2, -1)
                dx = torch._grouped_mm(dq.dequantize(dt), wt, offs=offs).to(x.dtype)  # (M, K)
            if ctx.needs_input_grad[1]:
                grads = []
                for xs, dys in zip(x.split(ctx.sizes), dy.split(ctx.sizes), strict=True):
                    if xs.shape[0] == 0:  # an idle expert: no tokens, a zero gradient
                        grads.append(weight.new_zeros(weight.shape[1:], dtype=dt))
                        continue
                    dyt = _q(dys.t(), recipe, "grad_output")  # (N, m), tiles along tokens
                    xt = _q(xs.t(), recipe, "input")  # (K, m)
                    grads.append(fp8_gemm(dyt, xt, dt))  # (N, K)
                dw = torch.stack(grads).to(weight.dtype)
        return dx, dw, None, None, None, None, None


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: list[int] | torch.Tensor,
    recipe: Recipe | None,
    bias: torch.Tensor | None = None,
    states: list[dict[str, DelayedState | None]] | None = None,
    fp8_activation: bool = False,
    grouped: bool = True,
    reduce_amax: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Per-group y_g = x_g W_gᵀ (+ b_g) for tokens sorted by group: x (tokens, in), weight
    (groups, out, in) -> (tokens, out); `recipe` None runs plain `F.linear`s.

    Blockwise, MXFP8 and rowwise run all groups at once, one grouped GEMM per pass
    (`_Fp8GroupedFn`), with the quantized values of one FP8 linear per group; `grouped=False`
    forces the per-group path, which per-tensor recipes (current, delayed) always take.

    Each non-empty group is quantized as one FP8 linear with its own scales: per-tensor recipes scale
    each expert's tokens and weight on their own (one outlier token moves only its
    expert's scale), blockwise uses 1 x 128 token tiles and a 128 x 128 grid per expert's
    weight, as DeepGEMM's grouped contiguous GEMM does. An empty group (an idle expert)
    computes nothing; under delayed scaling its histories still advance as TE's grouped
    linear advances them for an empty split (`_IdleGroupFn`), so every group's window spans
    the same micro-batches. The gradient of `weight` reaches every group through the slices
    (zeros for idle groups). `reduce_amax`: the roles sharded here (expert tensor
    parallelism), as for `fp8_linear`; every rank of the group must pass the same sizes."""
    sizes = group_sizes.tolist() if torch.is_tensor(group_sizes) else list(group_sizes)
    if len(sizes) != weight.shape[0] or sum(sizes) != x.shape[0]:
        raise ValueError(
            f"group_sizes {sizes} must have {weight.shape[0]} entries summing to the "
            f"{x.shape[0]} tokens of x"
        )
    out_dtype = _out_dtype(x)
    gemm_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    if (
        grouped
        and x.shape[0] > 0
        and _grouped_path(recipe, bias, fp8_activation)
        and grouped_mm_runs(x.device.type, gemm_dtype)
    ):
        red = {role: (reduce_amax or {}).get(role) for role in ROLES}
        return _Fp8GroupedFn.apply(x, weight, sizes, recipe, out_dtype, gemm_dtype, red)
    outs = []
    for g, xs in enumerate(x.split(sizes)):
        w, b = weight[g], None if bias is None else bias[g]
        st = None if states is None else states[g]
        if xs.shape[0] == 0 and isinstance(recipe, DelayedScaling):
            red_w = (reduce_amax or {}).get("weight")
            st = _checked_states(recipe, st)
            outs.append(_IdleGroupFn.apply(w, recipe, st, _out_dtype(xs), red_w))
        elif xs.shape[0] == 0:
            outs.append(xs.new_zeros(0, w.shape[0], dtype=_out_dtype(xs)))
        elif recipe is None:
            outs.append(F.linear(xs, w, b))
        else:
            outs.append(fp8_linear(xs, w, b, recipe, st, fp8_activation, reduce_amax))
    return torch.cat(outs)  # (tokens, out)
