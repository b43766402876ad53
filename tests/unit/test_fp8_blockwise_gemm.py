"""The GPU path for DeepSeek-V3's blockwise FP8 GEMM (`torch.nn.functional.scaled_mm` with
1 x 128 / 128 x 128 scales), checked without a GPU:

- the scale layouts we build pass PyTorch's own shape and stride checks for every pairing
  (its meta kernel, the checks the CUDA kernel makes), and a row-major scale does not;
- the first-call check: a scaled_mm that answers right is used, one that answers wrong or
  raises is turned off and the emulation answers instead.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from hyperloom.engine.fp8 import gemm as g
from hyperloom.engine.fp8 import quantize_for
from hyperloom.engine.fp8.formats import E4M3
from hyperloom.engine.fp8.quantize import Fp8Tensor
from hyperloom.engine.fp8.recipes import BlockwiseScaling

pytestmark = pytest.mark.skipif(
    not hasattr(F, "scaled_mm"), reason="this torch has no torch.nn.functional.scaled_mm"
)
TILE, BLOCK = (1, 128), (128, 128)


def meta_operand(rows: int, k: int, block: tuple[int, int]) -> Fp8Tensor:
    scales = torch.empty(-(-rows // block[0]), -(-k // block[1]), device="meta")
    data = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device="meta")
    return Fp8Tensor(data, scales, block, E4M3, pow2=True)


@pytest.mark.parametrize("k", [128, 640, 1024])  # K / 128 = 1, 5 (padded to 8), 8
@pytest.mark.parametrize("blocks", [(TILE, BLOCK), (TILE, TILE), (BLOCK, TILE)])
def test_scale_layouts_pass_pytorchs_checks(blocks, k):
    a, b = meta_operand(256, k, blocks[0]), meta_operand(384, k, blocks[1])
    ra, rb = g._block_scaling(a), g._block_scaling(b)
    sa, sb = g.blockwise_scales(a, ra), g.blockwise_scales(b, rb)
    out = F.scaled_mm(a.data, b.data.t(), sa, ra, sb, rb, output_dtype=torch.bfloat16)
    assert out.shape == (256, 384)
    if k == 128:
        return  # one scale per row: any stride will do
    with pytest.raises(RuntimeError, match="blockwise scaling"):  # row-major: refused
        F.scaled_mm(a.data, b.data.t(), a.scale_inv, ra, sb, rb, output_dtype=torch.bfloat16)


def test_only_whole_128_blocks_go_to_cublas():
    assert g._block_scaling(meta_operand(256, 200, TILE)) is None  # K not whole blocks
    assert g._block_scaling(meta_operand(200, 256, BLOCK)) is None  # rows not whole blocks
    assert g._block_scaling(meta_operand(200, 256, TILE)) == F.ScalingType.BlockWise1x128
    assert g._block_scaling(meta_operand(256, 256, (1, 32))) is None  # MXFP8: not this path


def fake_scaled_mm(wrong: bool = False):
    """F.scaled_mm as its documentation and PyTorch's samples describe it (decode each
    operand with its scales, one GEMM); `wrong` swaps the meaning of a 1 x 128 scale's axes."""
    calls = []

    def decode(mat: torch.Tensor, scale: torch.Tensor, scaling, rows_first: bool):
        x = mat.float() if rows_first else mat.t().float()  # (rows, K)
        rows, k = x.shape
        if scaling == F.ScalingType.BlockWise128x128:
            s = scale.t()[:, : k // 128]  # (rows / 128, K / 128)
            s = s.repeat_interleave(128, 0)
        else:
            s = scale.t().t() if not wrong else scale.t().reshape(rows, -1)
        return x * s.repeat_interleave(128, 1)[:rows, :k]

    def fake(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
        calls.append((recipe_a, recipe_b))
        a = decode(mat_a, scale_a, recipe_a, True)
        b = decode(mat_b, scale_b, recipe_b, False)
        return (a @ b.t()).to(output_dtype)

    return fake, calls


def operands(m: int = 256, n: int = 384, k: int = 640):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10
    w = torch.randn(n, k, generator=gen) * 0.02
    recipe = BlockwiseScaling()
    return quantize_for(x, recipe, "input"), quantize_for(w, recipe, "weight")


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(g, "_SCALED_MM_FAILED", set())
    monkeypatch.setattr(g, "_BLOCKWISE_CHECKED", set())


def test_a_scaled_mm_that_agrees_is_used(fresh, monkeypatch):
    fake, calls = fake_scaled_mm()
    monkeypatch.setattr(F, "scaled_mm", fake)
    qa, qb = operands()
    out = g._blockwise_scaled_mm(qa, qb, torch.bfloat16)
    ref = qa.dequantize() @ qb.dequantize().t()
    assert out is not None and ((out.float() - ref).norm() / ref.norm()) < 4e-3
    assert calls == [(F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)]
    g._blockwise_scaled_mm(qa, qb, torch.bfloat16)  # checked once: the second call trusts it
    assert len(g._BLOCKWISE_CHECKED) == 1 and not g._SCALED_MM_FAILED


def test_a_scaled_mm_that_disagrees_is_turned_off(fresh, monkeypatch, caplog):
    fake, calls = fake_scaled_mm(wrong=True)
    monkeypatch.setattr(F, "scaled_mm", fake)
    qa, qb = operands()
    ref = qa.dequantize() @ qb.dequantize().t()
    with caplog.at_level(logging.WARNING, logger="hyperloom.engine.fp8"):
        out = g._blockwise_scaled_mm(qa, qb, torch.bfloat16)
    assert torch.equal(out, ref.to(torch.bfloat16))  # the emulation answered
    assert "from the emulation on its first call" in caplog.text
    assert g._blockwise_scaled_mm(qa, qb, torch.bfloat16) is None and len(calls) == 1


def test_a_scaled_mm_that_raises_is_turned_off(fresh, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA >= 12.9 required")

    monkeypatch.setattr(F, "scaled_mm", refuse)
    qa, qb = operands()
    assert g._blockwise_scaled_mm(qa, qb, torch.bfloat16) is None
    assert len(g._SCALED_MM_FAILED) == 1


def test_cpu_keeps_the_emulation(fresh, monkeypatch):
    fake, calls = fake_scaled_mm()
    monkeypatch.setattr(F, "scaled_mm", fake)
    qa, qb = operands()
    g.fp8_gemm(qa, qb, torch.bfloat16)
    assert calls == []  # the GPU path is for GPUs; CPU runs the exact BF16 emulation
