"""The compiled kernels (torch.compile, seconds per graph on a small CPU: kept to one op) and
the fallback to eager when compiling fails."""

from __future__ import annotations

import importlib
import logging

import torch

from hyperloom.engine import ops
from hyperloom.engine.ops import kernels


def test_compiled_kernels_match_reference(monkeypatch):
    """Forward kernel of SwiGLU compiled (one graph: the first costs ~20 s of Inductor start-up
    on two cores); the backward kernels share the machinery and are checked in the benchmark."""
    monkeypatch.setenv("HYPERLOOM_OPS_COMPILE", "1")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 33, generator=g), torch.randn(5, 33, generator=g)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        y = ops.swiglu(a, b, impl="fused")
    swiglu_module = importlib.import_module("hyperloom.engine.ops.swiglu")
    assert not swiglu_module._fwd._failed  # it really compiled
    torch.testing.assert_close(y, ops.swiglu_reference(a, b))


def test_compile_failure_falls_back_to_eager_and_logs_once(monkeypatch, caplog):
    monkeypatch.setenv("HYPERLOOM_OPS_COMPILE", "1")

    def broken_compile(fn, **_):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    k = kernels.Kernel(lambda x: x * 2)
    with caplog.at_level(logging.WARNING, logger="hyperloom.engine.ops"):
        assert torch.equal(k(torch.ones(3)), torch.full((3,), 2.0))
        assert torch.equal(k(torch.ones(3)), torch.full((3,), 2.0))
    warnings = [r for r in caplog.records if "torch.compile failed" in r.message]
    assert len(warnings) == 1


def test_kill_switch_runs_eagerly(monkeypatch):
    monkeypatch.setenv("HYPERLOOM_OPS_COMPILE", "0")
    monkeypatch.setattr(torch, "compile", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    k = kernels.Kernel(lambda x: x + 1)
    assert torch.equal(k(torch.zeros(2)), torch.ones(2))
