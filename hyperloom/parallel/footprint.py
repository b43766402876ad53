"""What a rank holds for training state, measured: the bytes of its parameters, gradients,
optimizer moments and FP32 master weights.

The layout tests and benchmarks/parallel_layouts.py check that a layout divides these as it
promises, on the tensors a rank really has rather than by arithmetic.
"""

from __future__ import annotations

import torch

from hyperloom.parallel.layout import ParallelModel
from hyperloom.parallel.zero1 import ZeroOneAdamW


def local_state_bytes(pm: ParallelModel, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer moments (step counters
    excluded): what the layout promises to divide, measured rather than assumed."""

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(pm.inner.parameters())
    if isinstance(opt, ZeroOneAdamW):
        moments, master = [opt.exp_avg, opt.exp_avg_sq], nbytes(opt.master)
    else:  # the parameters are the FP32 master weights
        moments = [v for p in params for v in opt.state.get(p, {}).values() if v.dim() > 0]
        master = sum(nbytes(p) for p in params)
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(nbytes(v) for v in moments),
        "master": master,
    }
