"""The blockwise attention kernels ring attention is built from: one block's output and
log-sum-exp, and its share of the gradients given the merged rows' statistics."""

from __future__ import annotations

import importlib

import pytest
import torch

block = importlib.import_module("hyperloom.engine.ops.attention")


@pytest.mark.parametrize(
    "hq,hk,d,dv,s,t,causal",
    [(4, 2, 8, 8, 37, 37, True), (4, 1, 8, 8, 20, 33, False), (4, 4, 12, 8, 40, 40, True)],
)
@pytest.mark.parametrize("score_bytes", [block.SCORE_BYTES, 16 * 40 * 4 * 8])
@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_block_equals_reference(hq, hk, d, dv, s, t, causal, score_bytes, cpu_kernel, monkeypatch):
    """Output, lse and gradients against the float32 reference (GQA, one kv head, MLA's
    narrower v), through the CPU kernel where it applies and the math whole and in pieces of
    query rows."""
    monkeypatch.setattr(block, "SCORE_BYTES", score_bytes)
    assert block._cpu_flash(*(torch.empty(1, 1, 1, n) for n in (d, d, dv))) == (d == dv)
    if not cpu_kernel:
        monkeypatch.setattr(block, "_cpu_flash", lambda *a: False)
    gen = torch.Generator().manual_seed(s + t)
    q, k = torch.randn(2, hq, s, d, generator=gen), torch.randn(2, hk, t, d, generator=gen)
    v = torch.randn(2, hk, t, dv, generator=gen)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = block.attention_reference(*ref_in, is_causal=causal)
    dout = torch.randn(ref.shape, generator=gen)
    ref.backward(dout)
    out, lse = block.attention_block(q, k, v, causal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    scores = (q @ k.repeat_interleave(hq // hk, 1).transpose(-2, -1)) / d**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(s, t, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    grads = block.attention_block_backward(q, k, v, out, dout, lse, causal)
    for got, want in zip(grads, ref_in, strict=True):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-5)


def test_two_blocks_merge_to_the_whole():
    """Two key blocks merged by their lse (online softmax) give attention over all keys, and
    each block's backward with the merged statistics sums to the whole gradient."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen) for _ in range(3))
    out_a, lse_a = block.attention_block(q, k[:, :, :5], v[:, :, :5], False)
    out_b, lse_b = block.attention_block(q, k[:, :, 5:], v[:, :, 5:], False)
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * (lse_a - lse).exp()[..., None] + out_b * (lse_b - lse).exp()[..., None]
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = block.attention_reference(*ref_in, is_causal=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    dout = torch.randn(ref.shape, generator=gen)
    ref.backward(dout)
    ga = block.attention_block_backward(q, k[:, :, :5], v[:, :, :5], out, dout, lse, False)
    gb = block.attention_block_backward(q, k[:, :, 5:], v[:, :, 5:], out, dout, lse, False)
    torch.testing.assert_close(ga[0] + gb[0], ref_in[0].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([ga[1], gb[1]], 2), ref_in[1].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([ga[2], gb[2]], 2), ref_in[2].grad, rtol=1e-5, atol=1e-5)
