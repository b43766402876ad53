"""FP8 formats and the element-wise cast: scale, saturate, round to nearest even.

E4M3 (`float8_e4m3fn`, largest finite 448, no infinities) and E5M2 (`float8_e5m2`, largest
finite 57344, IEEE Inf/NaN), per Micikevicius et al., arXiv 2209.05433. A format choice names
what each GEMM operand uses: "hybrid" (E4M3 forward, E5M2 for gradients, which need range more
than precision; TransformerEngine's default) or "e4m3" everywhere (DeepSeek-V3 §3.3, where
fine-grained scales keep gradients in range).

The cast saturates: values scaled past the largest finite value clamp to it. torch's own
conversion turns +-Inf into +-448 for E4M3, hiding an overflow, so `cast_to_fp8` maps Inf to
NaN for E4M3 and keeps it for E5M2: a non-finite input stays visibly non-finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One 8-bit floating-point format."""

    name: str
    dtype: torch.dtype
    max: float  # largest finite value
    has_inf: bool


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, has_inf=False)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, has_inf=True)

FORMAT_CHOICES = ("hybrid", "e4m3")

# Which role a tensor plays in a linear layer's three GEMMs. Forward roles are E4M3 under
# both choices; gradient roles are E5M2 under "hybrid".
FORWARD_ROLES = ("input", "weight")
GRAD_ROLES = ("grad_output",)
ROLES = FORWARD_ROLES + GRAD_ROLES


def check_format_choice(choice: str) -> None:
    if choice not in FORMAT_CHOICES:
        raise ValueError(
            f"fp8 format {choice!r} is not one of {FORMAT_CHOICES}: 'hybrid' = E4M3 forward and "
            f"E5M2 gradients, 'e4m3' = E4M3 everywhere"
        )


def format_for(choice: str, role: str) -> Fp8Format:
    """The format a tensor in `role` ("input", "weight", "grad_output") is cast to."""
    check_format_choice(choice)
    if role not in ROLES:
        raise ValueError(f"fp8 tensor role {role!r} is not one of {ROLES}")
    return E5M2 if (choice == "hybrid" and role in GRAD_ROLES) else E4M3


def cast_to_fp8(x_scaled: torch.Tensor, fmt: Fp8Format, overwrite: bool = False) -> torch.Tensor:
    """Saturating, round-to-nearest-even cast of already scaled float values to `fmt`.

    NaN stays NaN; +-Inf becomes NaN in E4M3 (no Inf encoding) and stays +-Inf in E5M2.
    `overwrite=True` lets the cast use `x_scaled` (a temporary of the caller's) as its
    scratch space instead of allocating: the quantizers pass their scaled copy.
    """
    if not fmt.has_inf:
        # Inf * 0 = NaN and finite * 0 = +-0, so adding x * 0 turns exactly the infinities
        # into NaN; the clamp then saturates the finite values and keeps NaN. Two passes in
        # place, where isinf + where take two more and two allocations.
        y = x_scaled if overwrite else x_scaled.clone()
        y.addcmul_(x_scaled, _ZERO).clamp_(-fmt.max, fmt.max)
        return y.to(fmt.dtype)
    y = x_scaled.clamp(-fmt.max, fmt.max)  # clamp keeps NaN
    return torch.where(torch.isinf(x_scaled), x_scaled, y).to(fmt.dtype)


_ZERO = torch.zeros(())
_LUT: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def fp8_to_float(q: torch.Tensor) -> torch.Tensor:
    """FP8 values as FP32, bit for bit `q.float()`, through a 256-entry table.

    Why not `q.float()`: on CPU, PyTorch converts E4M3 element by element in a scalar loop,
    3.2 ms per million values on this project's CPU, five times a table lookup (0.67 ms) and
    a tenth of an FP32 GEMM's time on the same operand; each FP8 GEMM converts both operands.
    The table is the format's own conversion of all 256 codes, so NaN payloads and signed
    zeros come out as `float()` gives them. Other devices convert natively.
    """
    if q.device.type != "cpu":
        return q.float()
    if not q.is_contiguous() and q.dim() == 2 and q.t().is_contiguous():
        return fp8_to_float(q.t()).t()  # a transposed view: look up in storage order
    key = (q.dtype, q.device)
    lut = _LUT.get(key)
    if lut is None:
        codes = torch.arange(256, dtype=torch.uint8, device=q.device)
        lut = _LUT[key] = codes.view(q.dtype).float()
    idx = q.contiguous().view(torch.uint8).reshape(-1).int()
    return lut.index_select(0, idx).view(q.shape)


def quantize_tensorwise(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """q = cast(x * scale): `scale` is the multiplier (fp8_max / amax for current scaling)."""
    return cast_to_fp8(x.float() * scale, fmt, overwrite=True)


def dequantize_tensorwise(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x ~= q * scale_inv (scale_inv = 1 / scale)."""
    return (fp8_to_float(q) * scale_inv).to(dtype)
