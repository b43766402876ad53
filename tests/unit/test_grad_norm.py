"""The gradient norm for clipping: float64 sums of float32 slice norms."""

from __future__ import annotations

import torch

from hyperloom.accelerator import NORM_SLICE, sum_of_squares


def test_sum_of_squares_matches_float64_without_float64_copies():
    torch.manual_seed(0)
    grads = [torch.randn(16384, 384), torch.randn(3 * NORM_SLICE + 7), torch.randn(5, 3).t()]
    exact = sum((g.double() ** 2).sum() for g in grads)
    got = sum_of_squares(grads, torch.device("cpu"))
    assert got.dtype == torch.float64
    assert abs(got.item() / exact.item() - 1) < 1e-6  # float32 over whole tensors: ~1e-4
    whole = torch.stack(torch._foreach_norm(grads)).double().square().sum()
    assert abs(got.item() / exact.item() - 1) < abs(whole.item() / exact.item() - 1)
    bf16 = [g.bfloat16() for g in grads]  # low-precision gradients: a float64 accumulator
    exact16 = sum((g.double() ** 2).sum() for g in bf16)
    assert abs(sum_of_squares(bf16, torch.device("cpu")).item() / exact16.item() - 1) < 1e-6
    assert sum_of_squares([], torch.device("cpu")).item() == 0.0
