"""What a rank holds for training, measured: the bytes of its parameters, gradients,
optimizer moments and FP32 master weights, and the activations a forward saves for backward.

The layout tests and benchmarks/parallel_layouts.py check that a layout divides these as it
promises, on the tensors a rank really has rather than by arithmetic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

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


@contextlib.contextmanager
def saved_activations(model: nn.Module) -> Iterator[dict[int, int]]:
    """Count what autograd saves for backward inside the block: {storage address: bytes},
    each storage once however many views of it are saved, `model`'s parameters left out
    (weights, not activations). Activation memory as Korthikanti et al. (arXiv 2205.05198)
    count it, measured on this rank's tensors."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen
