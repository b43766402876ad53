"""FP8 GEMM: out = A Bᵀ for A (M, K) and B (N, K) quantized along K, higher-precision out.

Two paths with the same numerics:

- `torch._scaled_mm` when both operands have one scale per tensor or per row (scales
  spanning all of K): the scales factor out of the sum, out = diag(sa) (Aq Bqᵀ) diag(sb).
  It runs on CPU in PyTorch >= 2.x (tensorwise and rowwise, FP32/BF16 out; checked in
  tests/unit/test_fp8_gemm.py to equal the emulation bit for bit in FP32) and on CUDA SM89+.
  If the device rejects a call (unsupported shape or dtype pair) we fall back to the
  emulation and log it once.
- An emulation for scales that change along K (blockwise 128, MX 32): for each K-chunk of
  one scale block, the FP8 products are summed in FP32, multiplied by that chunk's scales and
  added to an FP32 accumulator -- DeepSeek-V3's promotion of partial sums to FP32 every
  N_C = 128 elements (arXiv 2412.19437 §3.3.2), which is also how DeepGEMM applies scales.

`tensor_core_gemm` models what the promotion is for: an accumulator that keeps only
`acc_mantissa_bits` (DeepSeek measured about 14 bits on H800) and is flushed into FP32 every
`promote_every` elements, or never. It exists to measure that effect, not to train with.
"""

from __future__ import annotations

import logging

import torch

from hyperloom.engine.fp8.quantize import Fp8Tensor

log = logging.getLogger("hyperloom.engine.fp8")

_SCALED_MM_FAILED: set[tuple] = set()


def _k_block(q: Fp8Tensor) -> int:
    """Columns per scale block along K (K itself when one scale spans the row)."""
    return min(q.block[1], q.shape[1])


def _row_scales(q: Fp8Tensor) -> torch.Tensor:
    """(rows, K-blocks) scales: the block scales repeated over each block's rows."""
    return q.scale_inv.repeat_interleave(min(q.block[0], q.shape[0]), 0)[: q.shape[0]]


def fp8_gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a (M, K) @ b (N, K)ᵀ -> (M, N) in `out_dtype`, both quantized along K."""
    (m, k), (n, k2) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"fp8_gemm: contraction dims differ, a is {(m, k)} and b is {(n, k2)}")
    ka, kb = _k_block(a), _k_block(b)
    if ka == k and kb == k:
        return _rowwise_gemm(a, b, out_dtype)
    chunk = min(ka, kb)
    if max(ka, kb) % chunk or (ka != k and ka != chunk) or (kb != k and kb != chunk):
        raise ValueError(
            f"fp8_gemm: scale blocks along K must match or span K: a has {ka}, b has {kb} of "
            f"K = {k}; requantize one operand"
        )
    return _chunked_gemm(a, b, chunk).to(out_dtype)


def _rowwise_gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    sa, sb = _row_scales(a), _row_scales(b).t()  # (M, 1), (1, N)
    if a.is_tensorwise and b.is_tensorwise:
        sa, sb = sa[:1, :1].reshape(()), sb[:1, :1].reshape(())
    key = (a.data.device.type, a.data.dtype, b.data.dtype, out_dtype, sa.dim())
    if key not in _SCALED_MM_FAILED:
        try:
            return torch._scaled_mm(
                a.data.contiguous(),
                b.data.contiguous().t(),  # column-major (K, N), as _scaled_mm wants
                sa.contiguous(),
                sb.contiguous(),
                out_dtype=out_dtype,
            )
        except (RuntimeError, NotImplementedError) as exc:
            _SCALED_MM_FAILED.add(key)
            log.info("torch._scaled_mm unavailable for %s (%s); emulating", key, exc)
    return ((a.data.float() * sa) @ (b.data.float() * sb).t()).to(out_dtype)


def _chunked_gemm(a: Fp8Tensor, b: Fp8Tensor, chunk: int) -> torch.Tensor:
    """Σ over K-chunks of (Aq_c Bq_cᵀ in FP32) * sa_c sb_cᵀ, accumulated in FP32."""
    (m, k), n = a.shape, b.shape[0]
    sa, sb = _row_scales(a), _row_scales(b)  # (M, Ka-blocks), (N, Kb-blocks)
    af, bf = a.data.float(), b.data.float()
    out = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    for c, start in enumerate(range(0, k, chunk)):
        sl = slice(start, min(start + chunk, k))
        col_a = sa[:, c if sa.shape[1] > 1 else 0].unsqueeze(1)  # (M, 1)
        col_b = sb[:, c if sb.shape[1] > 1 else 0].unsqueeze(0)  # (1, N)
        out.add_((af[:, sl] @ bf[:, sl].t()) * (col_a * col_b))
    return out


def truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """FP32 values with the mantissa cut to `bits` (round toward zero), a model of a
    reduced-precision accumulator."""
    if not 0 <= bits <= 23:
        raise ValueError(f"mantissa bits must lie in [0, 23], got {bits}")
    mask = -(1 << (23 - bits))  # ones in sign, exponent and the kept mantissa bits
    return (x.float().contiguous().view(torch.int32) & mask).view(torch.float32)


def tensor_core_gemm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    promote_every: int | None = 128,
    acc_mantissa_bits: int = 13,
    mma_k: int = 32,
) -> torch.Tensor:
    """A model of a tensor-core FP8 GEMM with a limited-precision accumulator (FP32 out).

    Each `mma_k`-wide step's products (scaled by their blocks' scales) are added into an
    accumulator truncated to `acc_mantissa_bits` after every add; every `promote_every`
    elements of K (None = never) the accumulator is added to an FP32 total and cleared.
    """
    (m, k), n = a.shape, b.shape[0]
    if promote_every is not None and promote_every % mma_k:
        raise ValueError(f"promote_every ({promote_every}) must be a multiple of mma_k ({mma_k})")
    sa, sb = _row_scales(a), _row_scales(b)
    ka, kb = _k_block(a), _k_block(b)
    af, bf = a.data.float(), b.data.float()
    total = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    acc = torch.zeros_like(total)
    for start in range(0, k, mma_k):
        sl = slice(start, min(start + mma_k, k))
        scale = sa[:, start // ka].unsqueeze(1) * sb[:, start // kb].unsqueeze(0)
        acc = truncate_mantissa(acc + (af[:, sl] @ bf[:, sl].t()) * scale, acc_mantissa_bits)
        if promote_every is not None and (start + mma_k) % promote_every == 0:
            total += acc
            acc.zero_()
    return total + acc
