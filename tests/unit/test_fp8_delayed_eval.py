"""Delayed scaling in eval mode: validation quantizes with the scales training would use
next and leaves the amax histories alone, so evaluating never changes the training run."""

from __future__ import annotations

import torch
from torch import nn

from hyperloom.engine.fp8 import DelayedScaling, Fp8Linear


def test_eval_forward_uses_the_next_scale_and_changes_no_state():
    torch.manual_seed(0)
    lin = Fp8Linear.from_linear(nn.Linear(64, 32), DelayedScaling(amax_history_len=4))
    lin.reset_fp8_state()
    x = torch.randn(8, 64)
    lin(x).sum().backward()  # one training step fills the histories
    state = [b.clone() for b in lin.buffers()]

    lin.eval()
    with torch.no_grad():
        y_eval = lin(3 * x)
    assert all(torch.equal(a, b) for a, b in zip(state, lin.buffers(), strict=True))

    lin.train()  # the next training forward quantizes with the same scales
    y_train = lin(3 * x)
    assert torch.equal(y_eval, y_train.detach())
    assert not all(torch.equal(a, b) for a, b in zip(state, lin.buffers(), strict=True))
