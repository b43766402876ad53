"""SwiGLU activation `silu(a) · b` (Shazeer, arXiv 2002.05202), the gate of a Llama MLP.

Unfused, autograd keeps three (tokens, ffn_dim) tensors, the block's widest activations. The
fused operator saves only its two inputs and recomputes the sigmoid (as Liger's
`LigerSiLUMulFunction`):

    s = σ(a),  ∂a = ∂y · b · s · (1 + a · (1 − s)),  ∂b = ∂y · a · s

Compiled, the math runs in float32 with the exponential taken as 2^(-a · log2 e) (cheaper on
CPU, where the exponential bounds this operator; the extra rounding is ~1e-7 relative), cast
once to the inputs' dtype. The eager fallback uses native-dtype ops as the reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperloom.engine.ops import triton_kernels
from hyperloom.engine.ops.kernels import check_impl, kernel

LOG2E = 1.4426950408889634  # log2(e): e^x = 2^(x · log2 e)


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: `silu(a) * b`."""
    return F.silu(a) * b


def _fwd_native(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def _bwd_native(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    # What autograd of the reference computes, in the inputs' dtype (eager: no upcast passes).
    return torch.ops.aten.silu_backward(dy * b, a), dy * F.silu(a)


@kernel(eager=_fwd_native, triton=triton_kernels.swiglu_fwd)
def _fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    af = a.float()
    # a / (1 + e^-a) rather than a * sigmoid(a): one multiply less per element, and on a CPU
    # the exponential, not the bytes, bounds this kernel (module docstring).
    y = af / (1 + torch.exp2(af * -LOG2E)) * b.float()
    return y.to(torch.promote_types(a.dtype, b.dtype))


@kernel(eager=_bwd_native, triton=triton_kernels.swiglu_bwd)
def _bwd(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    af, bf, g = a.float(), b.float(), dy.float()
    s = 1 / (1 + torch.exp2(af * -LOG2E))
    gs = g * s
    da = gs * bf * (1 + af - af * s)
    db = gs * af
    return da.to(a.dtype), db.to(b.dtype)


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, impl):
        ctx.save_for_backward(a, b)
        ctx.impl = impl
        return _fwd(a, b, impl=impl)

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        da, db = _bwd(dy, a, b, impl=ctx.impl)
        return da, db, None


def swiglu(a: torch.Tensor, b: torch.Tensor, impl: str = "fused") -> torch.Tensor:
    """`silu(a) * b` for same-shaped a, b; `impl` as in `hyperloom.engine.ops.rms_norm`."""
    check_impl(impl)
    if impl == "reference":
        return swiglu_reference(a, b)
    if a.shape != b.shape:
        raise ValueError(f"swiglu needs equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    return _FusedSwiGLU.apply(a, b, impl)
