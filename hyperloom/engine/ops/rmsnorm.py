"""RMSNorm (Zhang & Sennrich, arXiv 1910.07467), optionally fused with the residual add before it.

The fused operator does `r = x + f(x)` and `norm(r)` in one pass and returns both (Liger's and
Apex's `FusedAddRMSNorm`). The norm is computed in float32 and cast back to the residual's
dtype, as the reference does. Backward saves only `r` (an output anyway), the weight and one
float32 `1/rms` per token, and recomputes the normalised activations:

    x̂ = r · rstd,   y = x̂ · w
    ∂r = rstd · (g − x̂ · mean(g · x̂)),  g = ∂y · w;   ∂w = Σ_tokens ∂y · x̂
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperloom.engine.ops import triton_kernels
from hyperloom.engine.ops.kernels import check_impl, kernel


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: `norm(x)`, or `(norm(residual + x), residual + x)` when residual is given."""
    r = x if residual is None else residual + x
    y = F.rms_norm(r.float(), (r.shape[-1],), weight.float(), eps).to(r.dtype)
    return y if residual is None else (y, r)


@kernel(triton=triton_kernels.rms_norm_fwd)
def _fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    r = x if residual is None else residual + x  # (n, dim)
    rf = r.float()
    rstd = torch.rsqrt(rf.square().mean(-1, keepdim=True) + eps)  # (n, 1)
    y = (rf * rstd * weight.float()).to(r.dtype)
    return y, r, rstd


@kernel(triton=triton_kernels.rms_norm_bwd)
def _bwd(dy: torch.Tensor, dr_out: torch.Tensor | None, r: torch.Tensor, weight, rstd):
    xhat = r.float() * rstd  # (n, dim), recomputed
    g = dy.float() * weight.float()
    dr = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dr_out is not None:
        dr = dr + dr_out.float()
    dw = (dy.float() * xhat).sum(0)  # (dim,)
    return dr, dw


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, impl):
        shape, dim = x.shape, x.shape[-1]
        x2 = x.reshape(-1, dim)  # (tokens, dim)
        res2 = None if residual is None else residual.reshape(-1, dim)
        y, r, rstd = _fwd(x2, res2, weight, eps, impl=impl)
        ctx.save_for_backward(r, weight, rstd)
        ctx.impl, ctx.has_residual = impl, residual is not None
        ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)
        y = y.view(shape)
        if residual is None:
            return y
        return y, r.view(shape)

    @staticmethod
    def backward(ctx, dy, dr_out=None):
        r, weight, rstd = ctx.saved_tensors
        dim = r.shape[-1]
        dy2 = dy.reshape(-1, dim)  # (tokens, dim)
        dr2 = None if dr_out is None else dr_out.reshape(-1, dim)
        dr, dw = _bwd(dy2, dr2, r, weight, rstd, impl=ctx.impl)
        dr = dr.view(dy.shape)
        dx = dr.to(ctx.dtypes[0])
        dres = dr.to(ctx.dtypes[1]) if ctx.has_residual else None
        return dx, dres, dw.to(weight.dtype), None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    impl: str = "fused",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x` (..., dim), or of `residual + x` returning `(normed, residual + x)`.

    `impl`: "reference" (plain PyTorch), "fused" (custom autograd with compiled kernels),
    "fused_eager" (the same custom autograd, kernels run eagerly) or "triton" (the same
    custom autograd with hand-written Triton kernels where Triton runs, else as "fused").
    """
    check_impl(impl)
    if impl == "reference":
        return rms_norm_reference(x, weight, eps, residual)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    return _FusedRMSNorm.apply(x, residual, weight, eps, impl)
