"""FP8 formats, quantizers and scaling recipes against hand-worked reference numbers."""

from __future__ import annotations

import math

import pytest
import torch

from hyperloom.engine.fp8 import (
    E4M3,
    E5M2,
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    MXFP8Scaling,
    RowwiseScaling,
    format_for,
    quantize_for,
)
from hyperloom.engine.fp8.formats import cast_to_fp8
from hyperloom.engine.fp8.quantize import round_down_pow2, scale_from_amax
from hyperloom.engine.fp8.recipes import DelayedState

NAN, INF = float("nan"), float("inf")


def cast(values, fmt):
    return cast_to_fp8(torch.tensor(values, dtype=torch.float32), fmt).float().tolist()


# --------------------------------------------------------------------------- formats


def test_format_choice():
    assert format_for("hybrid", "input") is E4M3 and format_for("hybrid", "weight") is E4M3
    assert format_for("hybrid", "grad_output") is E5M2
    assert format_for("e4m3", "grad_output") is E4M3
    with pytest.raises(ValueError, match="'hybrid' = E4M3 forward"):
        format_for("e5m2", "input")
    with pytest.raises(ValueError, match="role"):
        format_for("hybrid", "output")
    assert (E4M3.max, E5M2.max) == (448.0, 57344.0)


def test_round_to_nearest_even():
    # E4M3 spacing in [1, 2) is 1/8: ties go to the even mantissa.
    assert cast([1.0625, 1.1875, 1.0625 + 2**-10, -1.0625], E4M3) == [1.0, 1.25, 1.125, -1.0]
    # Subnormals: the smallest E4M3 step is 2^-9; half of it ties to 0, 1.5 steps to 2 steps.
    assert cast([2**-10, 3 * 2**-10], E4M3) == [0.0, 2**-8]
    # E5M2 spacing in [1, 2) is 1/4.
    assert cast([1.125, 1.375, 1.126], E5M2) == [1.0, 1.5, 1.25]


def test_saturation():
    assert cast([448.0, 464.0, 500.0, -1e6], E4M3) == [448.0, 448.0, 448.0, -448.0]
    assert cast([57344.0, 6e4, -1e9], E5M2) == [57344.0, 57344.0, -57344.0]


def test_nan_and_inf():
    e4 = cast([NAN, INF, -INF, 1.0], E4M3)
    assert all(math.isnan(v) for v in e4[:3]) and e4[3] == 1.0  # no Inf in E4M3 ("fn")
    e5 = cast([NAN, INF, -INF], E5M2)
    assert math.isnan(e5[0]) and e5[1:] == [INF, -INF]


# --------------------------------------------------------------------------- scales


def test_scale_from_amax_extremes_follow_te():
    amax = torch.tensor([4.0, 0.0, INF, NAN, 1e-45])
    s = scale_from_amax(amax, 448.0)
    assert s[0] == 112.0 and s[1] == 1.0 and s[2] == 1.0 and s[3] == 1.0
    assert s[4] == torch.finfo(torch.float32).max  # 448 / 1e-45 overflows
    assert scale_from_amax(torch.tensor([0.0]), 448.0, eps=1e-4)[0] == pytest.approx(448 / 1e-4)
    assert round_down_pow2(torch.tensor([149.33, 128.0, 0.3])).tolist() == [128.0, 128.0, 0.25]


def test_current_scaling_hand_worked():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    q = quantize_for(x, CurrentScaling(), "input")
    assert q.scale_inv.item() == pytest.approx(4 / 448)  # scale = 448 / amax = 112
    assert q.data.float().tolist() == [[112.0, -224.0], [56.0, 448.0]]
    assert torch.equal(q.dequantize(), x)  # every scaled value is representable


def test_rowwise_hand_worked():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0], [0.0, 0.0]])
    q = quantize_for(x, RowwiseScaling(power_2_scale=False), "weight")
    assert q.scale_inv.flatten().tolist() == pytest.approx([2 / 448, 4 / 448, 1.0])
    assert q.data.float().tolist() == [[224.0, -448.0], [56.0, 448.0], [0.0, 0.0]]
    # The default rounds the multipliers 224 and 112 down to 128 and 64 (torchao's rowwise).
    q = quantize_for(x, RowwiseScaling(), "weight")
    assert q.scale_inv.flatten().tolist() == [1 / 128, 1 / 64, 1.0]
    assert q.data.float().tolist() == [[128.0, -256.0], [32.0, 256.0], [0.0, 0.0]]


def test_blockwise_tiles_pow2_and_padding():
    torch.manual_seed(0)
    x = torch.randn(3, 300)  # 300 = 2 * 128 + 44: the last tile is padded
    x[1, 260] = 3.0  # amax of row 1's last tile; 448 / 3 = 149.3 -> 128 (power of two)
    x[1, 256:] = x[1, 256:].clamp(-3, 3)
    x[2, :128] = 0.0  # an all-zero tile
    q = quantize_for(x, BlockwiseScaling(), "input")
    assert q.shape == (3, 300) and q.scale_inv.shape == (3, 3) and q.block == (1, 128)
    assert q.scale_inv[1, 2].item() == 1 / 128
    assert q.scale_inv[2, 0].item() == 1.0 and torch.all(q.data[2, :128].float() == 0)
    assert torch.isfinite(q.scale_inv).all()
    s = q.scale_inv.log2()
    assert torch.equal(s, s.round())  # every scale a power of two
    rel = (q.dequantize() - x).abs() / x.abs().clamp_min(1e-3)
    assert rel.max() < 2**-3  # E4M3 keeps 3 mantissa bits once in range


def test_blockwise_weight_blocks():
    torch.manual_seed(0)
    w = torch.randn(130, 200) * 0.02
    w[129, 199] = 1.0  # the corner block (rows 128-129, cols 128-199) gets its own scale
    q = quantize_for(w, BlockwiseScaling(power_2_scale=False), "weight")
    assert q.block == (128, 128) and q.scale_inv.shape == (2, 2)
    assert q.scale_inv[1, 1].item() == pytest.approx(1 / 448)
    assert q.scale_inv[0, 0].item() == pytest.approx(w[:128, :128].abs().max().item() / 448)
    assert q.transposable and torch.equal(q.t().dequantize(), q.dequantize().t())


def test_mxfp8_e8m0_scales_ceil_and_floor():
    x = torch.zeros(2, 70)  # 70 = 2 * 32 + 6
    x[0, 0] = 500.0  # block (0, 0): amax 500
    x[0, 40] = 56.0  # block (0, 1): amax 56 = 448 / 8, an exact power-of-two ratio
    x[1, 65] = 1.0  # block (1, 2), the padded one: amax 1
    q = quantize_for(x, MXFP8Scaling(), "input")
    assert q.scale_inv.shape == (2, 3)
    # ceil(log2(amax / 448)): 500 -> 2^1, 56 -> 2^-3, 1 -> 2^-8; zero blocks -> 2^-127.
    assert q.scale_inv[0].tolist() == [2.0, 2**-3, 2**-127]
    assert q.scale_inv[1].tolist() == [2**-127, 2**-127, 2**-8]
    # 500 / 2 = 250 rounds to 256 (E4M3 step 16 in [128, 256)); 56 * 8 = 448 is exact.
    assert q.dequantize()[0, 0] == 512.0 and q.dequantize()[0, 40] == 56.0
    assert q.scale_e8m0().view(torch.uint8)[0].tolist() == [128, 124, 0]  # bias 127
    # OCP reference rounding: 2^(floor(log2 amax) - 8): 500 -> 2^0, so 500 saturates to 448.
    f = quantize_for(x, MXFP8Scaling(scale_rounding="floor"), "input")
    assert f.scale_inv[0, 0].item() == 1.0 and f.dequantize()[0, 0] == 448.0
    nan = x.clone()
    nan[1, 3] = NAN
    assert torch.isnan(quantize_for(nan, MXFP8Scaling(), "input").dequantize()[1, :32]).all()


@pytest.mark.parametrize(
    "recipe", [CurrentScaling(), RowwiseScaling(), BlockwiseScaling(), MXFP8Scaling()]
)
def test_nan_and_inf_propagate_through_every_recipe(recipe):
    x = torch.ones(2, 40)
    x[0, 1], x[1, 2] = NAN, INF
    d = quantize_for(x, recipe, "input").dequantize()
    assert math.isnan(d[0, 1]) and not math.isfinite(d[1, 2])


# --------------------------------------------------------------------------- delayed


def _delayed_run(recipe: DelayedScaling, amaxes: list[float]) -> tuple[list[float], torch.Tensor]:
    hist = torch.zeros(recipe.amax_history_len, 1)
    scale = torch.ones(1)
    state = DelayedState(hist, scale, 0)
    used = []
    for a in amaxes:
        x = torch.tensor([[a, -a / 2]])
        used.append(1.0 / quantize_for(x, recipe, "input", state).scale_inv.item())
    return used, hist[:, 0]


def test_delayed_history_window_max():
    a = [1.0, 4.0, 2.0, 0.5, 0.25, 8.0]
    used, hist = _delayed_run(DelayedScaling(amax_history_len=3), a)
    # Call i uses the scale from the window of the last 3 amaxes before it (scale 1 at first).
    expected = [1.0] + [448 / max(a[max(0, i - 3) : i]) for i in range(1, len(a))]
    assert used == pytest.approx(expected)
    # TE layout after the last call: position 0 = newest amax, then oldest .. newer ones.
    assert hist.tolist() == [8.0, 0.5, 0.25]


def test_delayed_most_recent_and_margin():
    a = [1.0, 4.0, 2.0]
    used, _ = _delayed_run(DelayedScaling(amax_history_len=8, amax_compute_algo="most_recent"), a)
    assert used == pytest.approx([1.0, 448 / 1.0, 448 / 4.0])
    used, _ = _delayed_run(DelayedScaling(amax_history_len=8, margin=2), a)
    assert used == pytest.approx([1.0, 448 / 1.0 / 4, 448 / 4.0 / 4])


def test_delayed_keeps_scale_on_zero_or_nonfinite_amax():
    used, _ = _delayed_run(DelayedScaling(amax_history_len=1), [2.0, 0.0, 3.0, INF, 1.0])
    assert used == pytest.approx([1.0, 224.0, 224.0, 448 / 3, 448 / 3])


def test_delayed_scale_overflowing_fp32_becomes_fp32_max():
    # 448 / 1e-40 (a subnormal amax) is Inf in FP32; TE clamps it to FP32's max, so the next
    # tensor's zeros stay zeros (0 x Inf would be NaN) and its small values stay finite.
    hist, scale = torch.zeros(4, 1), torch.ones(1)
    state = DelayedState(hist, scale, 0)
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    quantize_for(torch.tensor([[1e-40, 0.0]]), recipe, "input", state)
    q = quantize_for(torch.tensor([[1e-40, 0.0]]), recipe, "input", state)
    assert scale.item() == torch.finfo(torch.float32).max
    d = q.dequantize()
    assert torch.isfinite(d).all() and d[0, 1] == 0 and d[0, 0] > 0


def test_recipe_arguments_are_checked():
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="'ceil'"):
        MXFP8Scaling(scale_rounding="up")
    with pytest.raises(ValueError, match="DelayedState"):
        quantize_for(torch.ones(2, 2), DelayedScaling(), "input")
