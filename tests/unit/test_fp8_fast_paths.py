"""The CPU fast paths of the FP8 engine give the numbers of the plain formulation.

Each fast path replaces a slower formulation whose numerics the rest of the FP8 tests pin:
the table lookup replaces `fp8.float()`, quantizing a transposed view replaces quantizing its
transposed copy, the dequantize-then-GEMM replaces DeepSeek-V3's chunk-by-chunk promotion, the
BF16 GEMM of power-of-two-scaled operands replaces the FP32 GEMM rounded to BF16, and the
in-place saturating cast replaces clamp + isinf + where. Each test compares the two.
"""

from __future__ import annotations

import pytest
import torch

from hyperloom.engine.fp8 import (
    BlockwiseScaling,
    CurrentScaling,
    MXFP8Scaling,
    RowwiseScaling,
    fp8_gemm,
    quantize_for,
)
from hyperloom.engine.fp8.formats import E4M3, E5M2, cast_to_fp8, fp8_to_float
from hyperloom.engine.fp8.quantize import Fp8Tensor, abs_max, block_amax

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_table_conversion_is_float_for_every_code(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    ref = codes.float()
    got = fp8_to_float(codes)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # NaNs, -0 included
    m = codes.view(16, 16)
    for view in (m, m.t(), m[:, ::2]):  # contiguous, transposed, strided
        out = fp8_to_float(view)
        assert out.shape == view.shape
        assert torch.equal(out.view(torch.int32), view.float().view(torch.int32))


def _reference_cast(x: torch.Tensor, fmt) -> torch.Tensor:
    """The plain formulation: clamp, then put the infinities back (E5M2) or NaN (E4M3)."""
    y = x.clamp(-fmt.max, fmt.max)
    y = torch.where(torch.isinf(x), x if fmt.has_inf else torch.full_like(y, NAN), y)
    return y.to(fmt.dtype)


def _same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal codes, NaN for NaN (a generated NaN's sign bit is the CPU's choice)."""
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    codes_a, codes_b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(nan_a, nan_b) and torch.equal(codes_a[~nan_a], codes_b[~nan_b])


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_in_place_cast_equals_clamp_and_where(fmt):
    x = torch.tensor([0.0, -0.0, 1.0, -3.3, 448.0, 470.0, -1e6, 6e4, INF, -INF, NAN, 1e-9])
    x = torch.cat([x, torch.randn(200) * 300])
    ref = _reference_cast(x, fmt)
    kept = x.clone()
    assert _same_fp8(cast_to_fp8(x, fmt), ref)
    assert torch.equal(x.view(torch.int32), kept.view(torch.int32))  # input untouched
    scratch = x.clone()
    assert _same_fp8(cast_to_fp8(scratch, fmt, overwrite=True), ref)
    assert torch.isnan(cast_to_fp8(x, fmt)[8:11].float()).all() != fmt.has_inf  # Inf: NaN in E4M3


def test_abs_max_and_block_amax_match_abs_amax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 300, generator=g)
    assert torch.equal(abs_max(x), x.abs().amax())
    for block in ((1, 128), (128, 1), (128, 128), (256, 300)):
        rows, cols = -(-256 // block[0]), -(-300 // block[1])
        padded = torch.nn.functional.pad(x, (0, cols * block[1] - 300, 0, rows * block[0] - 256))
        ref = padded.abs().view(rows, block[0], cols, block[1]).amax(dim=(1, 3))
        assert torch.equal(block_amax(x, block), ref), block
    zeros = -torch.zeros(4, 128)  # an all -0 tile: its max is +0, a degenerate amax
    assert torch.equal(block_amax(zeros, (1, 128)).view(torch.int32), torch.zeros(4, 1).int())
    assert abs_max(zeros).view(torch.int32).item() == 0
    x[3, 7] = NAN
    assert torch.isnan(abs_max(x)) and torch.isnan(block_amax(x, (1, 128))[3, 0])


@pytest.mark.parametrize(
    "recipe,role",
    [
        (BlockwiseScaling(), "input"),
        (BlockwiseScaling(), "grad_output"),
        (BlockwiseScaling(), "weight"),
        (RowwiseScaling(), "input"),
        (CurrentScaling(), "input"),
        (MXFP8Scaling(), "input"),
    ],
)
def test_quantizing_a_transposed_view_equals_quantizing_its_copy(recipe, role):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(200, 136, generator=g) * 5).bfloat16()  # odd sizes: padded blocks
    view, copy = x.t(), x.t().contiguous()
    q_view, q_copy = quantize_for(view, recipe, role), quantize_for(copy, recipe, role)
    assert q_view.shape == q_copy.shape and q_view.block == q_copy.block
    assert torch.equal(q_view.data.view(torch.uint8), q_copy.data.view(torch.uint8))
    assert torch.equal(q_view.scale_inv, q_copy.scale_inv)
    assert q_view.pow2 == q_copy.pow2
    assert torch.equal(q_view.dequantize(), q_copy.dequantize())


def _chunk_by_chunk(a: Fp8Tensor, b: Fp8Tensor, chunk: int) -> torch.Tensor:
    """DeepSeek-V3's formulation: per K-chunk, FP32 sum of FP8 products, times that chunk's
    two scales, added into an FP32 accumulator."""
    (m, k), n = a.shape, b.shape[0]
    sa = a.scale_inv.repeat_interleave(min(a.block[0], m), 0)[:m]
    sb = b.scale_inv.repeat_interleave(min(b.block[0], n), 0)[:n]
    out = torch.zeros(m, n, dtype=torch.float64)
    for c, start in enumerate(range(0, k, chunk)):
        sl = slice(start, start + chunk)
        part = (a.data[:, sl].float() @ b.data[:, sl].float().t()).double()
        out += part * (sa[:, c : c + 1].double() * sb[:, c].double().unsqueeze(0))
    return out


@pytest.mark.parametrize("recipe", [BlockwiseScaling(), MXFP8Scaling()])
def test_dequantize_then_gemm_is_the_chunk_by_chunk_sum(recipe):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(64, 1000, generator=g), torch.randn(72, 1000, generator=g) * 0.02
    qa, qb = quantize_for(x, recipe, "input"), quantize_for(w, recipe, "weight")
    ref = _chunk_by_chunk(qa, qb, recipe.block)
    got = fp8_gemm(qa, qb)
    assert got.dtype == torch.float32
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-6, err  # FP32 summation order only; FP8 rounding alone is ~3e-2


@pytest.mark.parametrize("recipe", [BlockwiseScaling(), RowwiseScaling(), MXFP8Scaling()])
def test_bf16_output_is_the_fp32_gemm_rounded_once(recipe):
    """Power-of-two scales make the operands exact in BF16, and the BF16 GEMM accumulates in
    FP32: its output is the FP32 GEMM's rounded to BF16 (at most one BF16 unit apart where
    the FP32 summation order differs)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(96, 640, generator=g), torch.randn(80, 640, generator=g) * 0.05
    qa, qb = quantize_for(x, recipe, "input"), quantize_for(w, recipe, "weight")
    assert qa.pow2 and qb.pow2
    fp32 = fp8_gemm(qa, qb)
    bf16 = fp8_gemm(qa, qb, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    ulp = fp32.bfloat16().float().abs() * 2.0**-7
    assert ((bf16.float() - fp32.bfloat16().float()).abs() <= ulp).all()
    assert (bf16 == fp32.bfloat16()).float().mean() > 0.99


def test_non_pow2_scales_keep_the_fp32_gemm():
    """Current scaling's scales are not powers of two by default: the dequantized operands
    are not exact in BF16, so BF16 output is the FP32 GEMM rounded, exactly."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(32, 256, generator=g) * 3.1, torch.randn(48, 256, generator=g)
    qa, qb = quantize_for(x, CurrentScaling(), "input"), quantize_for(w, CurrentScaling(), "weight")
    assert not qa.pow2
    assert torch.equal(fp8_gemm(qa, qb, torch.bfloat16), fp8_gemm(qa, qb).bfloat16())
