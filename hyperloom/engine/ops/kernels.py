"""torch.compile for the fused operators' kernels, with a clean fallback to eager PyTorch.

Each fused operator's forward and backward call small pure-tensor functions ("kernels"), which
Inductor turns into one loop nest (CPU) or Triton kernel (GPU); we choose what is saved for
backward rather than the partitioner. A `Kernel` runs eagerly when asked (`fused_eager`, used
by unit tests), when `HYPERLOOM_OPS_COMPILE=0`, when already traced by an outer
torch.compile, or after compiling failed once (one warning). A kernel may carry a
hand-written Triton launcher (`@kernel(triton=...)`) that `impl="triton"` runs where Triton
can launch, falling back to the compiled route otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from hyperloom.engine.ops import triton_kernels

log = logging.getLogger("hyperloom.engine.ops")

IMPLS = ("reference", "fused", "fused_eager", "triton")


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


def preload_triton() -> None:
    """Import triton now if it is installed. torch.compile's first call imports it even when
    it builds CPU kernels -- about 90 MB of resident memory per process on the development
    container -- so a process that measures its memory from a baseline taken before the model
    (the trainer, for the planner's self-check) counts it with the runtime it starts from, not
    with the job, as it does when triton is absent."""
    if importlib.util.find_spec("triton") is None:
        return
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install shows up where it is used
        log.debug("triton did not import (%s)", exc)


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"unknown op implementation {impl!r}; expected one of {IMPLS}")


_GRAPHS_PER_KERNEL = 32


class Kernel:
    """A pure tensor function, compiled on first use when allowed, eager otherwise.

    `eager`, if given, is what runs uncompiled instead of `fn` itself: the same result by a
    route that is cheap without fusion (e.g. native-dtype ops where `fn` upcasts to float32,
    which Inductor fuses for free but eager PyTorch pays for in whole extra passes).
    `triton`, if given, is a hand-written launcher returning what `fn` returns, run for
    `impl="triton"`.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        eager: Callable[..., Any] | None = None,
        triton: Callable[..., Any] | None = None,
    ):
        self.fn = fn
        self.eager = eager or fn
        self.triton = triton
        self.name = fn.__name__
        self._compiled: Callable[..., Any] | None = None
        self._failed = False
        self._triton_failed = False

    def __call__(self, *args: Any, impl: str = "fused") -> Any:
        """Run on `args` by the route `impl` names: "fused" (compiled), "fused_eager" or
        "triton" (see the module docstring for when each falls back)."""
        if torch.compiler.is_compiling():
            return self.eager(*args)
        if impl == "triton" and self._triton_runs(args):
            try:
                return self.triton(*args)
            except Exception as exc:  # noqa: BLE001 - a backend Triton cannot compile for
                self._triton_failed = True
                where = f"{self.fn.__module__}.{self.name}"
                _warn_fallback(f"Triton kernel {where} failed", exc, 'the "fused" route')
        if impl == "fused_eager" or self._failed or not compile_allowed():
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
            _warn_fallback(
                f"torch.compile failed for fused kernel {self.name}", exc, "eager PyTorch"
            )
            return self.eager(*args)

    def _triton_runs(self, args: tuple[Any, ...]) -> bool:
        if self.triton is None or self._triton_failed:
            return False
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return triton_kernels.runs_on(device)


def _warn_fallback(failure: str, exc: Exception, instead: str) -> None:
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    log.warning("%s (%s: %s); using %s for it", failure, type(exc).__name__, first_line, instead)


def kernel(
    fn: Callable[..., Any] | None = None,
    *,
    eager: Callable[..., Any] | None = None,
    triton: Callable[..., Any] | None = None,
) -> Any:
    """Decorator: `@kernel def _fwd(...)` makes `_fwd(*args, impl=...)`;
    `@kernel(eager=other)` runs `other` when not compiled, `@kernel(triton=launch)` runs
    `launch` for `impl="triton"`."""
    if fn is None:
        return lambda f: Kernel(f, eager, triton)
    return Kernel(fn, eager, triton)
