"""FP8 linears under split backward (Zero Bubble / DualPipe): the weight-gradient GEMM is
queued in B and run at W, in FP8, giving bit for bit the gradients of a whole backward; the
delayed-scaling state advances in F and B only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperloom.engine.fp8 import convert_to_fp8, recipe_from_name, reset_fp8_state
from hyperloom.pipeline.split_backward import DeferWeightGrads, WeightGradStore


def _model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 64, bias=False))
    convert_to_fp8(m, recipe_from_name(recipe), keep=())
    reset_fp8_state(m)
    return m


@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise", "blockwise", "mxfp8"])
def test_deferred_fp8_weight_grads_equal_a_whole_backward(recipe):
    x = torch.randn(2, 8, 256, generator=torch.Generator().manual_seed(1))
    whole, split = _model(recipe), _model(recipe)
    for _ in range(2):  # the second step quantizes with the first one's delayed history
        whole(x).square().mean().backward()

        store = WeightGradStore()
        with DeferWeightGrads(store):
            out = split(x)
        snap = [None if p.grad is None else p.grad.clone() for p in split.parameters()]
        with store.collect("mb"):
            out.square().mean().backward()
        for p, g in zip(split.parameters(), snap, strict=True):  # B left them alone
            assert (p.grad is None and g is None) or torch.equal(p.grad, g)
        queued = store._queues["mb"]
        assert [job.__name__ for job in queued] == ["fp8_wgrad"] * 2
        before = split[2].fp8_amax_history.clone() if recipe == "delayed" else None
        assert store.flush("mb") == 2
        if before is not None:  # W touched no scaling state
            assert torch.equal(before, split[2].fp8_amax_history)
    for (name, a), b in zip(whole.named_parameters(), split.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    if recipe == "delayed":
        for a, b in zip(whole.buffers(), split.buffers(), strict=True):
            assert torch.equal(a, b)


def test_a_whole_backward_under_the_mode_runs_weight_grads_at_once():
    m = _model("current")
    store = WeightGradStore()
    with DeferWeightGrads(store):
        out = m(torch.randn(4, 256))
    out.sum().backward()  # not collecting: a BW action
    assert store.pending() == [] and all(p.grad is not None for p in m.parameters())
