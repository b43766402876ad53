"""Fused operators vs their references: forward and every gradient, many shapes and dtypes.

The fused operators run with `impl="fused_eager"` here -- the same custom autograd functions
and kernel arithmetic as "fused", without paying torch.compile's seconds per graph
(test_ops_compile.py covers the compiled kernels). Inputs include odd sizes and
non-contiguous views (transposed, strided slices), as the model produces them.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hyperloom.engine import ops

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def leaf(t: torch.Tensor, noncontig: bool) -> torch.Tensor:
    """A leaf requiring grad; non-contiguous (a transposed copy seen back) when asked."""
    if noncontig:
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
        assert not t.is_contiguous() or t.dim() == 1 or t.shape[0] == 1
    return t.detach().requires_grad_(True)


def grads_of(fn, inputs, probe):
    """Outputs of fn(*inputs) and the gradients of Σ probe_i · out_i wrt every input."""
    for t in inputs:
        t.grad = None
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(((o.float() * p).sum() for o, p in zip(outs, probe, strict=True))).backward()
    return [o.detach() for o in outs], [t.grad for t in inputs]


def assert_same(fused_fn, ref_fn, inputs, dtype):
    with torch.no_grad():
        outs = ref_fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    probe = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7)) for o in outs]
    got, got_g = grads_of(fused_fn, inputs, probe)
    want, want_g = grads_of(ref_fn, inputs, probe)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL[dtype])
    for a, b in zip(got_g, want_g, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **TOL[dtype])


SHAPES = [(1, 1, 8), (2, 7, 33), (3, 5, 64), (4, 129)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("noncontig", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm(dtype, shape, noncontig, residual):
    g = torch.Generator().manual_seed(0)
    x = leaf(torch.randn(shape, generator=g).to(dtype), noncontig)
    w = leaf(1 + 0.1 * torch.randn(shape[-1], generator=g), False)
    # The model's residual stream is float32 under autocast while the sub-layer output is bf16.
    r = leaf(torch.randn(shape, generator=g), noncontig) if residual else None
    inputs = [x, w] + ([r] if residual else [])

    def call(impl):
        if residual:
            return lambda x, w, r: ops.rms_norm(x, w, 1e-5, r, impl=impl)
        return lambda x, w: ops.rms_norm(x, w, 1e-5, impl=impl)

    assert_same(call("fused_eager"), call("reference"), inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 9, 37), (3, 16, 128)])
@pytest.mark.parametrize("noncontig", [False, True])
def test_swiglu(dtype, shape, noncontig):
    g = torch.Generator().manual_seed(1)
    a = leaf(3 * torch.randn(shape, generator=g).to(dtype), noncontig)
    b = leaf(torch.randn(shape, generator=g).to(dtype), noncontig)
    fused = lambda a, b: ops.swiglu(a, b, impl="fused_eager")  # noqa: E731
    assert_same(fused, ops.swiglu_reference, [a, b], dtype)


def tables(seq: int, rope_dim: int, scaling: float = 1.0):
    inv = ops.rope_inv_freq(rope_dim, 10000.0, scaling)
    return ops.rope_tables(inv, seq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,rope_dim",
    [
        ((1, 1, 1, 8), 8),
        ((2, 7, 3, 16), 16),
        ((2, 5, 4, 24), 8),  # decoupled RoPE: only the trailing 8 of 24 channels rotate
        ((3, 6, 1, 64), 64),  # MLA's single shared key head
        ((1, 9, 2, 20), 6),
    ],
)
@pytest.mark.parametrize("noncontig", [False, True])
def test_rope(dtype, shape, rope_dim, noncontig):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g).to(dtype)
    if noncontig:  # as q comes out of a projection: (b, s, h, d) viewed from (b, h, s, d)
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    x = x.detach().requires_grad_(True)
    cos, sin = tables(shape[1], rope_dim, scaling=8.0)
    fused = lambda x: ops.rope(x, cos, sin, impl="fused_eager")  # noqa: E731
    assert_same(fused, lambda x: ops.apply_rope(x, cos, sin), [x], dtype)


def test_decoupled_rope_leaves_the_nope_channels_alone():
    x = torch.randn(2, 4, 3, 12)
    cos, sin = tables(4, 4)
    y = ops.rope(x, cos, sin, impl="fused_eager")
    assert torch.equal(y[..., :8], x[..., :8])
    torch.testing.assert_close(y[..., 8:], ops.apply_rope(x[..., 8:], cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,seq,head_dim", [(4, 2, 7, 16), (3, 3, 1, 8), (6, 1, 33, 32)]
)
def test_attention(dtype, heads, kv_heads, seq, head_dim):
    g = torch.Generator().manual_seed(3)
    q = leaf(torch.randn(2, heads, seq, head_dim, generator=g).to(dtype), False)
    k = leaf(torch.randn(2, kv_heads, seq, head_dim, generator=g).to(dtype), False)
    v = leaf(torch.randn(2, kv_heads, seq, head_dim, generator=g).to(dtype), False)
    fused = lambda q, k, v: ops.attention(q, k, v, impl="fused")  # noqa: E731
    assert_same(fused, ops.attention_reference, [q, k, v], dtype)


def test_attention_reference_stays_float32_under_autocast():
    # The yardstick must not round its scores to BF16 because the caller's autocast is on.
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g).bfloat16() for _ in range(3))
    plain = ops.attention_reference(q, k[:, :2], v[:, :2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = ops.attention_reference(q, k[:, :2], v[:, :2])
    assert torch.equal(autocast, plain)


def test_sdpa_reports_a_backend():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    backends = ops.sdpa_backends(q, k, k)
    assert "math" in backends  # always there; the first entry is what runs


def test_op_selection():
    assert ops.OpImpls.choose(fused=False).rmsnorm == "reference"
    chosen = ops.OpImpls.choose(compile=False, reference=["rope"])
    assert (chosen.rmsnorm, chosen.rope) == ("fused_eager", "reference")
    with pytest.raises(ValueError, match="unknown ops"):
        ops.OpImpls.choose(reference=["layernorm"])
    with pytest.raises(ValueError, match="unknown op implementation"):
        ops.swiglu(torch.ones(2), torch.ones(2), impl="cuda")


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_adamw_variants_agree(impl):
    """The optimizer build_optimizer picks (fused, else foreach) matches the for-loop one."""
    g = torch.Generator().manual_seed(4)
    params = [torch.randn(s, generator=g) for s in [(5, 3), (7,), (1,)]]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]

    def run(kind):
        ps = [p.clone().requires_grad_(True) for p in params]
        flags = {"fused": dict(fused=True), "foreach": dict(foreach=True)}.get(kind, {})
        if kind == "for-loop":
            flags = dict(foreach=False)
        opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **flags)
        for step in grads:
            for p, gr in zip(ps, step, strict=True):
                p.grad = gr.clone()
            opt.step()
        return ps

    for a, b in zip(run(impl), run("for-loop"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_compiled_source_matches_its_eager_route(dtype):
    """SwiGLU's kernels compile float32 math but run native-dtype ops when eager; the two
    routes agree (the float32 one is evaluated here without compiling)."""
    sw = importlib.import_module("hyperloom.engine.ops.swiglu")
    g = torch.Generator().manual_seed(5)
    a, b, dy = (torch.randn(7, 45, generator=g).to(dtype) for _ in range(3))
    torch.testing.assert_close(sw._fwd.fn(a, b), sw._fwd.eager(a, b), **TOL[dtype])
    for x, y in zip(sw._bwd.fn(dy, a, b), sw._bwd.eager(dy, a, b), strict=True):
        torch.testing.assert_close(x, y, **TOL[dtype])
