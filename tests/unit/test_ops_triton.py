"""The hand-written Triton kernels (engine/ops/triton_kernels.py) against the kernels they
stand in for and the references, and the fallback when Triton cannot run.

No GPU here: the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, which
tests/conftest.py sets before triton can be imported: Triton jits its own standard library
when `triton.language` is first imported). The interpreter runs each program in numpy, so the
shapes are small. It also truncates float32 -> bfloat16 where a GPU rounds to nearest, so
bf16 results may differ by one bf16 step: they are held to bf16 tolerance.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import pytest
import torch
from test_ops_fused import TOL, assert_same, leaf  # tests/unit is on sys.path under pytest

from hyperloom.config import load_config
from hyperloom.engine import ops
from hyperloom.engine.ops import kernels
from hyperloom.engine.ops import triton_kernels as tk

rn = importlib.import_module("hyperloom.engine.ops.rmsnorm")
sw = importlib.import_module("hyperloom.engine.ops.swiglu")

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (the test extra installs it)",
)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def interpret():
    if not tk.interpreting():
        pytest.skip("TRITON_INTERPRET is off: these tests run the interpreter on CPU tensors")
    assert tk.triton_available()


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values, laid out column-major (a transposed copy seen back)."""
    return t.t().contiguous().t()


def assert_results_match(got, want, dtype):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL[dtype])


# --------------------------------------------------------------------------- kernels


# (x dtype, residual dtype): the model's residual stream is float32 under autocast while the
# sub-layer output is bf16; a bf16 stream rounds the sum to bf16 before normalising it.
F32, BF16 = torch.float32, torch.bfloat16
RMSNORM_DTYPES = [(F32, None), (F32, F32), (BF16, None), (BF16, F32), (BF16, BF16)]


@needs_triton
@pytest.mark.parametrize("dtype,res_dtype", RMSNORM_DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 1), (3, 7), (257, 384), (2, 1000)])
@pytest.mark.parametrize("strided", [False, True])
def test_rmsnorm_kernels_match_the_compiled_ones(interpret, dtype, res_dtype, rows, dim, strided):
    """Forward and backward launchers against `_fwd`/`_bwd`'s torch.compile source (the
    float32 arithmetic the "fused" path compiles), results of the same dtypes and shapes."""
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    w = 1 + 0.1 * torch.randn(dim, generator=g)
    res = None if res_dtype is None else torch.randn(rows, dim, generator=g).to(res_dtype)
    dy = torch.randn(rows, dim, generator=g).to(dtype)
    dr_out = None if res_dtype is None else torch.randn(rows, dim, generator=g).to(res_dtype)
    if strided:
        x, dy = noncontig(x), noncontig(dy)
        res = None if res is None else noncontig(res)

    want = rn._fwd.fn(x, res, w, 1e-5)
    assert_results_match(tk.rms_norm_fwd(x, res, w, 1e-5), want, dtype)
    _, r, rstd = want
    assert_results_match(
        tk.rms_norm_bwd(dy, dr_out, r, w, rstd), rn._bwd.fn(dy, dr_out, r, w, rstd), dtype
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 1000), (2, 3, 384)])
@pytest.mark.parametrize("strided", [False, True])
def test_swiglu_kernels_match_the_compiled_ones(interpret, dtype, shape, strided):
    g = torch.Generator().manual_seed(len(shape))
    a, b, dy = (3 * torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    if strided:
        a, b, dy = (t.transpose(0, -1).contiguous().transpose(0, -1) for t in (a, b, dy))
    assert_results_match([tk.swiglu_fwd(a, b)], [sw._fwd.fn(a, b)], dtype)
    assert_results_match(tk.swiglu_bwd(dy, a, b), sw._bwd.fn(dy, a, b), dtype)


@needs_triton
def test_empty_inputs(interpret):
    x, w = torch.randn(0, 8), torch.ones(8)
    y, r, rstd = tk.rms_norm_fwd(x, None, w, 1e-5)
    assert y.shape == (0, 8) and rstd.shape == (0, 1)
    dr, dw = tk.rms_norm_bwd(x, None, r, w, rstd)
    assert dr.shape == (0, 8) and torch.equal(dw, torch.zeros(8))
    assert tk.swiglu_fwd(x, x).shape == (0, 8)


# --------------------------------------------------------------------------- through autograd


def counted(monkeypatch, k: kernels.Kernel) -> list[int]:
    """Count the calls of k's Triton launcher (so a silent fallback cannot pass a test)."""
    calls: list[int] = []
    launch = k.triton

    def run(*args):
        calls.append(1)
        return launch(*args)

    monkeypatch.setattr(k, "triton", run)
    return calls


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_triton_gradients_equal_the_reference(interpret, monkeypatch, dtype, residual):
    fwd, bwd = counted(monkeypatch, rn._fwd), counted(monkeypatch, rn._bwd)
    g = torch.Generator().manual_seed(0)
    x = leaf(torch.randn(2, 5, 24, generator=g).to(dtype), noncontig=True)
    w = leaf(1 + 0.1 * torch.randn(24, generator=g), False)
    # The model's residual stream is float32 under autocast while the sub-layer output is bf16.
    r = leaf(torch.randn(2, 5, 24, generator=g), noncontig=True) if residual else None
    inputs = [x, w] + ([r] if residual else [])

    def call(impl):
        return lambda x, w, *r: ops.rms_norm(x, w, 1e-5, *r, impl=impl)

    assert_same(call("triton"), call("reference"), inputs, dtype)
    assert fwd and bwd  # the Triton kernels ran, both ways


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_triton_gradients_equal_the_reference(interpret, monkeypatch, dtype):
    fwd, bwd = counted(monkeypatch, sw._fwd), counted(monkeypatch, sw._bwd)
    g = torch.Generator().manual_seed(1)
    a = leaf(3 * torch.randn(2, 9, 37, generator=g).to(dtype), noncontig=True)
    b = leaf(torch.randn(2, 9, 37, generator=g).to(dtype), noncontig=False)
    triton = lambda a, b: ops.swiglu(a, b, impl="triton")  # noqa: E731
    assert_same(triton, ops.swiglu_reference, [a, b], dtype)
    assert fwd and bwd


def test_ops_without_triton_kernels_take_their_fused_path(monkeypatch):
    monkeypatch.setenv("HYPERLOOM_OPS_COMPILE", "0")  # "fused" then runs its kernels eagerly
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 4, 2, 8, generator=g)
    cos, sin = ops.rope_tables(ops.rope_inv_freq(8, 10000.0), 4)
    assert torch.equal(ops.rope(x, cos, sin, "triton"), ops.rope(x, cos, sin, "fused_eager"))
    q = torch.randn(1, 2, 4, 8, generator=g)
    assert torch.equal(ops.attention(q, q, q, impl="triton"), ops.attention(q, q, q))
    h, wt, lab = torch.randn(6, 8, generator=g), torch.randn(11, 8, generator=g), torch.arange(6)
    ce = ops.linear_cross_entropy(h, wt, lab, impl="triton")
    assert torch.equal(ce, ops.linear_cross_entropy(h, wt, lab, impl="fused_eager"))


# --------------------------------------------------------------------------- selection, fallback


def test_choose_triton_where_it_runs(monkeypatch):
    monkeypatch.setattr(tk, "unavailable_reason", lambda: None)
    chosen = ops.OpImpls.choose(triton=True, reference=["swiglu"])
    assert (chosen.rmsnorm, chosen.swiglu, chosen.rope) == ("triton", "reference", "fused")
    assert ops.OpImpls.choose(fused=False, triton=True).rmsnorm == "reference"
    assert ops.OpImpls.choose().rmsnorm == "fused"  # off by default


@pytest.mark.parametrize("compile", [True, False])
def test_choose_falls_back_with_one_warning(monkeypatch, caplog, compile):
    monkeypatch.setattr(tk, "unavailable_reason", lambda: "triton is not installed")
    with caplog.at_level(logging.WARNING, logger="hyperloom.engine.ops"):
        chosen = ops.OpImpls.choose(compile=compile, triton=True)
    fast = "fused" if compile else "fused_eager"
    assert (chosen.rmsnorm, chosen.swiglu) == (fast, fast)
    (warning,) = caplog.records
    assert "ops.triton is on but triton is not installed" in warning.message
    assert "rmsnorm and swiglu" in warning.message


def test_unavailable_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = tk.unavailable_reason()
    if reason is None:
        pytest.skip("a GPU Triton can launch on is present")
    assert not tk.triton_available()
    assert "TRITON_INTERPRET=1" in reason or "not installed" in reason


def test_kernel_takes_the_fused_route_where_triton_cannot_run(monkeypatch):
    monkeypatch.setattr(tk, "runs_on", lambda device: False)
    k = kernels.Kernel(lambda x: x + 1, triton=lambda x: pytest.fail("Triton ran"))
    assert torch.equal(k(torch.zeros(2), impl="triton"), torch.ones(2))


def test_failed_triton_launch_falls_back_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(tk, "runs_on", lambda device: True)

    def broken(x):
        raise RuntimeError("no Triton backend for this GPU")

    k = kernels.Kernel(lambda x: x * 2, triton=broken)
    with caplog.at_level(logging.WARNING, logger="hyperloom.engine.ops"):
        for _ in range(2):
            assert torch.equal(k(torch.ones(3), impl="triton"), torch.full((3,), 2.0))
    (warning,) = caplog.records
    assert "Triton kernel" in warning.message and "no Triton backend" in warning.message


def test_config_knob():
    assert load_config(None, []).ops.triton is False
    assert load_config(None, ["--ops.triton", "true"]).ops.triton is True
