"""FP8 GEMM: out = A Bᵀ for A (M, K) and B (N, K) quantized along K, higher-precision out.

Three paths with the same numerics:

- `torch._scaled_mm` on GPUs (SM89+) when each operand has one scale per tensor or per row:
  the scales factor out of the sum, out = diag(sa) (Aq Bqᵀ) diag(sb).
- cuBLAS's block-scaled GEMM (`F.scaled_mm`, Hopper) for DeepSeek-V3's 1 x 128 / 128 x 128
  blocks. Its scale layouts follow PyTorch's OpInfo samples and have not run on a GPU here, so
  the first call of each pairing is checked against the emulation (`BLOCKWISE_CHECK_TOL`); a
  mismatch or error turns the path off with one warning.
- An emulation: dequantize each operand (FP8 value x block scale, in FP32), then one GEMM.
  CPU always takes it; it is faster there than `_scaled_mm`'s scalar E4M3 conversion.

For scales that change along K (blockwise, MX) the emulation is DeepSeek-V3's FP32 promotion
(arXiv 2412.19437 §3.3.2; DeepGEMM) taken to its limit: instead of scaling each 128-wide
partial sum, it scales the operands and accumulates all of K in FP32. The two are the same
sum, Σ_c sa_c sb_c Σ_{k in c} a_k b_k = Σ_k (a_k sa_c)(b_k sb_c); with power-of-two scales
every dequantized value is exact, so only the summation order differs, and one GEMM is much
cheaper than one per chunk (docs/fp8.md).

`tensor_core_gemm` models what promotion is for: an accumulator keeping `acc_mantissa_bits`
(DeepSeek measured about 14 on H800), flushed into FP32 every `promote_every` elements or
never. It measures that effect; it is not for training.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from hyperloom.engine.fp8.formats import fp8_to_float
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
    on_cpu = a.data.device.type == "cpu"
    if not on_cpu and (ka != k or kb != k):
        out = _blockwise_scaled_mm(a, b, out_dtype)
        if out is not None:
            return out
    if out_dtype == torch.bfloat16 and a.pow2 and b.pow2 and (on_cpu or ka != k or kb != k):
        # Exact operands in BF16: E4M3/E5M2 values carry 3/2 mantissa bits, BF16 7, and a
        # power-of-two scale only moves the exponent (BF16 has FP32's range). The BF16 GEMM
        # accumulates in FP32 and rounds once: on this project's CPU it gave the FP32 GEMM's
        # result rounded to BF16 bit for bit (K = 128-4096), at twice the FP32 GEMM's speed.
        return a.dequantize(torch.bfloat16) @ b.dequantize(torch.bfloat16).t()
    if ka == k and kb == k:
        return _rowwise_gemm(a, b, out_dtype)
    chunk = min(ka, kb)
    if max(ka, kb) % chunk or (ka != k and ka != chunk) or (kb != k and kb != chunk):
        raise ValueError(
            f"fp8_gemm: scale blocks along K must match or span K: a has {ka}, b has {kb} of "
            f"K = {k}; requantize one operand"
        )
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def _rowwise_gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    sa, sb = _row_scales(a), _row_scales(b).t()  # (M, 1), (1, N)
    if a.is_tensorwise and b.is_tensorwise:
        sa, sb = sa[:1, :1].reshape(()), sb[:1, :1].reshape(())
    key = (a.data.device.type, a.data.dtype, b.data.dtype, out_dtype, sa.dim())
    if a.data.device.type != "cpu" and key not in _SCALED_MM_FAILED:
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
    deq_b = fp8_to_float(b.data) * sb.t()  # (N, K) x (N, 1), or x a 0-dim scale
    return ((fp8_to_float(a.data) * sa) @ deq_b.t()).to(out_dtype)


BLOCKWISE_CHECK_TOL = 2e-2  # relative L2, cuBLAS's blockwise GEMM vs the emulation, first call
_BLOCKWISE_CHECKED: set[tuple] = set()  # pairings whose first call matched the emulation


def _block_scaling(q: Fp8Tensor):
    """`F.ScalingType` of an operand cuBLAS can take blockwise, else None: 1 x 128 tiles, or
    128 x 128 blocks over whole blocks, with K a multiple of 128."""
    rows, k = q.shape
    if k % 128:
        return None
    if q.block == (1, 128):
        return F.ScalingType.BlockWise1x128
    if q.block == (128, 128) and rows % 128 == 0:
        return F.ScalingType.BlockWise128x128
    return None


def blockwise_scales(q: Fp8Tensor, scaling) -> torch.Tensor:
    """The scales of `q` in the layout `F.scaled_mm` wants for `scaling`: outer-dim-major
    (column-major), (rows, K / 128) for 1 x 128 tiles and (K / 128 padded to a multiple of 4,
    rows / 128) for 128 x 128 blocks."""
    s = q.scale_inv.float()  # (rows / block rows, K / 128)
    if scaling == F.ScalingType.BlockWise128x128:
        pad = 4 * math.ceil(s.shape[1] / 4) - s.shape[1]
        s = F.pad(s, (0, pad), value=1.0)  # (rows / 128, L4)
        return s.contiguous().t()  # (L4, rows / 128), column-major
    return s.t().contiguous().t()  # (rows, K / 128), column-major


def _blockwise_scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype):
    """a @ bᵀ through cuBLAS's blockwise FP8 GEMM, or None where it does not apply, failed
    before, or failed its first-call check (see the module docstring)."""
    if not hasattr(F, "scaled_mm"):  # torch before the v2 scaled GEMM
        return None
    ra, rb = _block_scaling(a), _block_scaling(b)
    if ra is None or rb is None:
        return None
    if ra == rb == F.ScalingType.BlockWise128x128:
        return None  # not a pairing cuBLAS offers
    key = ("blockwise", a.data.device.type, a.data.dtype, b.data.dtype, out_dtype, ra, rb)
    if key in _SCALED_MM_FAILED:
        return None
    try:
        out = F.scaled_mm(
            a.data.contiguous(),
            b.data.contiguous().t(),  # column-major (K, N)
            blockwise_scales(a, ra),
            ra,
            blockwise_scales(b, rb),
            rb,
            output_dtype=out_dtype,
        )
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        _SCALED_MM_FAILED.add(key)
        log.info("blockwise F.scaled_mm unavailable for %s (%s); emulating", key, exc)
        return None
    if key not in _BLOCKWISE_CHECKED:
        ref = a.dequantize() @ b.dequantize().t()
        err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not err <= BLOCKWISE_CHECK_TOL:
            _SCALED_MM_FAILED.add(key)
            log.warning(
                "blockwise F.scaled_mm for %s is %.3g from the emulation on its first call "
                "(tolerance %g); emulating from now on",
                key,
                err,
                BLOCKWISE_CHECK_TOL,
            )
            return ref.to(out_dtype)
        _BLOCKWISE_CHECKED.add(key)
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
    af, bf = fp8_to_float(a.data), fp8_to_float(b.data)
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
