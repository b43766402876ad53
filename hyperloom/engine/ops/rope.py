"""Rotary position embedding (RoPE, arXiv 2104.09864) with context-extension frequency scaling.

Channels pair "half-split" (i with i + d/2, Hugging Face's `rotate_half`), so HF Llama
checkpoints load without permuting q/k; Meta's interleaved checkpoints are permuted by the
adapter. Llama 3.1's `apply_scaling` keeps short wavelengths, divides long ones by `factor` and
interpolates between; linear scaling (position interpolation, arXiv 2306.15595) divides every
frequency by `factor`; YaRN (arXiv 2309.00071) ramps between the two by rotations counted within
the original context and multiplies the tables by an attention factor (Hugging Face's
`_compute_yarn_parameters`, DeepSeek-V3's `precompute_freqs_cis`). Tables are computed in
float64 (fp32 loses precision past 100k tokens).
Decoupled RoPE (DeepSeek-V2 MLA, arXiv 2405.04434 §2.1.3) rotates only the trailing
`rope_dim` channels, with one key head shared by all query heads: pass narrower tables and/or
a (batch, seq, 1, rope_dim) key. The fused backward saves only the cos/sin tables, since the
rotation is orthogonal: ∂x = ∂y·cos + rotate_halfᵀ(∂y·sin), rotate_halfᵀ([a, b]) = [b, −a].
"""

from __future__ import annotations

import math

import torch

from hyperloom.engine.ops.kernels import check_impl, kernel


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq: int = 8192,
) -> torch.Tensor:
    """Inverse frequencies, shape (head_dim // 2,), float64, Llama-3.1 scaled when scaling > 1."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling <= 1.0:
        return inv_freq
    low_wavelen = original_max_seq / low_freq_factor
    high_wavelen = original_max_seq / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Interpolation weight: 0 at the low-frequency end of the band, 1 at the high end.
    smooth = (original_max_seq / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling, inv_freq)
    blended = (1 - smooth) * inv_freq / scaling + smooth * inv_freq
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def yarn_inv_freq(
    head_dim: int,
    theta: float,
    factor: float,
    original_max_seq: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """YaRN inverse frequencies (head_dim // 2,), float64: f_i where a pair turns more than
    `beta_fast` times within the original context, f_i / factor below `beta_slow` turns, a
    linear ramp between; the ramp's ends are the dimensions d(r) = D ln(L / (2π r)) / (2 ln θ),
    floored and ceiled (YaRN's `truncate`)."""
    inv = rope_inv_freq(head_dim, theta)
    if factor <= 1:
        return inv

    def correction_dim(rotations: float) -> float:
        return (
            head_dim
            * math.log(original_max_seq / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv * (1 - ramp) + inv / factor * ramp


def scaled_inv_freq(
    kind: str,
    head_dim: int,
    theta: float,
    factor: float = 1.0,
    *,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq: int = 8192,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """Inverse frequencies of RoPE scaling `kind`: default, linear, llama3 or yarn."""
    if kind == "linear":
        return rope_inv_freq(head_dim, theta) / max(factor, 1.0)
    if kind == "llama3":
        return rope_inv_freq(
            head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_seq
        )
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, factor, original_max_seq, beta_fast, beta_slow)
    if kind != "default":
        raise ValueError(f"unknown RoPE scaling {kind!r}; known: default, linear, llama3, yarn")
    return rope_inv_freq(head_dim, theta)


def rope_tables(
    inv_freq: torch.Tensor, max_seq_len: int, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_seq_len, head_dim), float32, half-split layout, both
    multiplied by `attention_factor` (YaRN's; it scales q·k by its square)."""
    pos = torch.arange(max_seq_len, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq)  # (seq, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim)
    return (angles.cos() * attention_factor).float(), (angles.sin() * attention_factor).float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_half_t(x: torch.Tensor) -> torch.Tensor:
    """The transpose (= inverse) of `rotate_half`."""
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], -x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, seq, heads, head_dim) by tables of shape (seq, rope_dim).

    rope_dim < head_dim rotates only the trailing rope_dim channels (decoupled RoPE).
    Computed in float32 and returned in x's dtype, so bf16 activations keep exact angles.
    """
    rope_dim = cos.shape[-1]
    if rope_dim < x.shape[-1]:
        keep, rot = x.split([x.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([keep, apply_rope(rot, cos, sin)], dim=-1)
    cos = cos[None, :, None, :]  # (1, seq, 1, head_dim)
    sin = sin[None, :, None, :]
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


@kernel
def _rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rope(x, cos, sin)


@kernel
def _rope_bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rope_dim = cos.shape[-1]
    keep, rot = dy.split([dy.shape[-1] - rope_dim, rope_dim], dim=-1)
    g = rot.float()
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, seq, 1, rope_dim)
    drot = (g * cos + rotate_half_t(g * sin)).to(dy.dtype)
    return torch.cat([keep, drot], dim=-1)


class _FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, impl):
        ctx.save_for_backward(cos, sin)  # tables only: no activation is kept
        ctx.impl = impl
        return _rope_fwd(x, cos, sin, impl=impl)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_bwd(dy, cos, sin, impl=ctx.impl), None, None, None


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "fused"
) -> torch.Tensor:
    """`apply_rope` through the chosen implementation (see `hyperloom.engine.ops.rms_norm`)."""
    check_impl(impl)
    if cos.shape[-1] > x.shape[-1] or cos.shape[-1] % 2:
        raise ValueError(f"rope tables of width {cos.shape[-1]} do not fit head_dim {x.shape[-1]}")
    if impl == "reference":
        return apply_rope(x, cos, sin)
    return _FusedRoPE.apply(x, cos, sin, impl)
