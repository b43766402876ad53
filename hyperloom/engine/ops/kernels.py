"""torch.compile for the fused operators' kernels, with a clean fallback to eager PyTorch.

Each fused operator is a custom `autograd.Function` whose forward and backward call small
pure-tensor functions ("kernels"): no autograd inside them, so torch.compile (Inductor) turns
each one into a single loop nest on CPU or a Triton kernel on GPU, and we decide exactly what
is saved for backward instead of leaving it to the partitioner.

A `Kernel` runs its function eagerly -- the same algorithm, unfused -- when

- the caller asks for eager (`impl="fused_eager"`, which the unit tests use: compiling costs
  seconds per graph on a small CPU and the arithmetic is what they check),
- `HYPERLOOM_OPS_COMPILE=0` is set in the environment (a process-wide kill switch),
- we are already being traced by torch.compile (an outer `train.compile` fuses it anyway),
- or compiling failed once (no compiler toolchain, an unsupported backend): it logs one warning
  per kernel and stays eager from then on.

Shapes vary (the last chunk of a loss, prompt vs decode steps), so the first recompile marks
the changed dimension dynamic (torch.compile's default `dynamic=None`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("hyperloom.engine.ops")

IMPLS = ("reference", "fused", "fused_eager")


def compile_allowed() -> bool:
    """False when HYPERLOOM_OPS_COMPILE=0 (read on every call, so tests can flip it)."""
    return os.environ.get("HYPERLOOM_OPS_COMPILE", "1") != "0"


def autocast_off(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A context with autocast disabled on `device`'s type (a no-op where the device type has
    no autocast): the ops' own dtype decisions then hold inside it."""
    dev = torch.device(device).type
    if torch.amp.is_autocast_available(dev):
        return torch.autocast(dev, enabled=False)
    return contextlib.nullcontext()


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"unknown op implementation {impl!r}; expected one of {IMPLS}")


_GRAPHS_PER_KERNEL = 32


class Kernel:
    """A pure tensor function, compiled on first use when allowed, eager otherwise.

    `eager`, if given, is what runs uncompiled instead of `fn` itself: the same result by a
    route that is cheap without fusion (e.g. native-dtype ops where `fn` upcasts to float32,
    which Inductor fuses for free but eager PyTorch pays for in whole extra passes).
    """

    def __init__(self, fn: Callable[..., Any], eager: Callable[..., Any] | None = None):
        self.fn = fn
        self.eager = eager or fn
        self.name = fn.__name__
        self._compiled: Callable[..., Any] | None = None
        self._failed = False

    def __call__(self, *args: Any, compile: bool = True) -> Any:
        if not compile or self._failed or not compile_allowed() or torch.compiler.is_compiling():
            return self.eager(*args)
        if self._compiled is None:
            # Each (dtype, width) a model uses is its own graph: MLA's norms alone bring three
            # widths in two dtypes, past torch's default of 8 graphs per function.
            limit = getattr(torch._dynamo.config, "recompile_limit", None)
            if limit is not None and limit < _GRAPHS_PER_KERNEL:
                torch._dynamo.config.recompile_limit = _GRAPHS_PER_KERNEL
            self._compiled = torch.compile(self.fn)
        # Kernels hold no autograd; detached inputs keep requires_grad (training vs
        # evaluation) out of the compiled graphs' guards.
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        try:
            return self._compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means "use eager"
            self._failed = True
            log.warning(
                "torch.compile failed for fused kernel %s (%s: %s); using eager PyTorch for it",
                self.name,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return self.eager(*args)


def kernel(fn: Callable[..., Any] | None = None, *, eager: Callable[..., Any] | None = None) -> Any:
    """Decorator: `@kernel def _fwd(...)` makes `_fwd(*args, compile=...)`;
    `@kernel(eager=other)` runs `other` when not compiled."""
    if fn is None:
        return lambda f: Kernel(f, eager)
    return Kernel(fn, eager)
