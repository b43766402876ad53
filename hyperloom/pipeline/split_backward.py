"""Split backward: input gradients now (B), weight gradients later (W).

Zero Bubble (arXiv 2401.10241 §2) splits a stage's backward: B, the input gradient the
previous stage waits for, and W, the weight gradients nobody waits for, which a schedule moves
into bubbles. For y = x Wᵀ the split is exact: ∂L/∂x = ∂L/∂y W, ∂L/∂W = (∂L/∂y)ᵀ x.

Under `DeferWeightGrads(store)` a `TorchFunctionMode` routes every `F.linear` with a trainable
weight through `_DeferrableLinear` (the model and tensor-parallel layers need no change): during
a collecting B it queues the weight-gradient product under the (stage, micro-batch) key, and W
accumulates it into `.grad`. Norms, embeddings and expert slices of stacked weights get their
gradients in B, as DualPipe's `WeightGradStore` does. FP8 linears defer their wgrad GEMMs
through the engine's `defer_weight_grads`. The store is captured at forward time because
autograd may run backward on another thread.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hyperloom.engine.fp8.modules import defer_weight_grads


class WeightGradStore:
    """Queues of deferred weight-gradient work, one per (stage, micro-batch) key."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, list[Callable[[], None]]] = defaultdict(list)
        self._collecting: Hashable | None = None

    @contextlib.contextmanager
    def collect(self, key: Hashable) -> Iterator[None]:
        """Inside: linear layers queue their weight gradients under `key` (a B action)."""
        if self._collecting is not None:
            raise RuntimeError(f"already collecting weight gradients for {self._collecting}")
        self._collecting = key
        try:
            yield
        finally:
            self._collecting = None

    def put(self, work: Callable[[], None]) -> bool:
        """Queue `work` if a B is collecting; False tells the caller to do it now."""
        if self._collecting is None:
            return False
        self._queues[self._collecting].append(work)
        return True

    def flush(self, key: Hashable) -> int:
        """Run (W) and drop the work queued under `key`; returns how many products ran."""
        work = self._queues.pop(key, [])
        with torch.no_grad():  # outside autograd's backward, grad mode is on again
            for job in work:
                job()
        return len(work)

    def pending(self) -> list[Hashable]:
        return [k for k, q in self._queues.items() if q]


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _DeferrableLinear(torch.autograd.Function):
    """F.linear whose weight (and bias) gradient can be queued in a `WeightGradStore`."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, compute_dtype):
        # Under autocast F.linear would compute in the autocast dtype; do that explicitly so
        # backward's products use the same dtype as forward's (as autocast's own linear does).
        xc, wc = x.to(compute_dtype), weight.to(compute_dtype)
        bc = bias.to(compute_dtype) if bias is not None else None
        ctx.save_for_backward(xc, wc)
        ctx.store, ctx.weight, ctx.bias = store, weight, bias
        ctx.x_dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.to(w.dtype)
        grad_x = (grad @ w).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        weight, bias = ctx.weight, ctx.bias

        def weight_grads() -> tuple[torch.Tensor, torch.Tensor | None]:
            g2 = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
            x2 = x.reshape(-1, x.shape[-1])  # (tokens, in)
            gw = g2.t() @ x2  # (out, in)
            gb = g2.sum(0) if bias is not None and bias.requires_grad else None
            return gw, gb

        def deferred() -> None:
            gw, gb = weight_grads()
            _accumulate(weight, gw)
            if gb is not None:
                _accumulate(bias, gb)

        if ctx.store.put(deferred):
            return grad_x, None, None, None, None
        gw, gb = weight_grads()
        return grad_x, gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype), None, None


class DeferWeightGrads(TorchFunctionMode):
    """Route `F.linear` calls with trainable weights through `_DeferrableLinear`."""

    def __init__(self, store: WeightGradStore) -> None:
        super().__init__()
        self.store = store
        self._fp8: contextlib.AbstractContextManager | None = None

    def __enter__(self):
        self._fp8 = defer_weight_grads(self.store.put)  # FP8 linears queue their wgrad too
        self._fp8.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            fp8, self._fp8 = self._fp8, None
            if fp8 is not None:
                fp8.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            # Only a parameter itself can take a deferred gradient: for a weight computed in
            # the forward (a slice of an expert stack, a cast copy) the gradient must flow on
            # through autograd to the parameter, so that linear runs as usual.
            leaves = weight.is_leaf and (bias is None or bias.is_leaf)
            if weight.requires_grad and leaves:
                dev = x.device.type
                dtype = (
                    torch.get_autocast_dtype(dev)
                    if torch.is_autocast_enabled(dev)
                    else torch.promote_types(x.dtype, weight.dtype)
                )
                return _DeferrableLinear.apply(x, weight, bias, self.store, dtype)
        return func(*args, **kwargs)
