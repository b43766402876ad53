"""Chunked linear cross-entropy: equal to the reference, never holds the full logits,
and vocab-parallel (two simulated tensor-parallel ranks as threads sharing a reduction)."""

from __future__ import annotations

import threading

import pytest
import torch

from hyperloom.engine import ops
from hyperloom.engine.ops.memory import AllocationTracker


def make(n_tokens, dim, vocab, dtype=torch.float32, ignore=0, seed=0, noncontig=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n_tokens, dim, generator=g).to(dtype)
    if noncontig:  # (tokens, dim) seen through a transpose
        h = h.t().contiguous().t()
    w = (0.2 * torch.randn(vocab, dim, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (n_tokens,), generator=g)
    labels[torch.randperm(n_tokens, generator=g)[:ignore]] = -100
    return h.requires_grad_(True), w.requires_grad_(True), labels


def loss_and_grads(fn, h, w, labels, **kw):
    h.grad = w.grad = None
    loss = fn(h, w, labels, **kw)
    (loss * 1.7).backward()  # a non-unit upstream gradient
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize(
    "n_tokens,dim,vocab,chunk,ignore",
    [
        (1, 8, 5, 0, 0),
        (37, 16, 100, 8, 3),
        (64, 12, 257, 0, 0),
        (50, 33, 61, 7, 49),
        (9, 4, 3, 64, 1),
    ],
)
@pytest.mark.parametrize("noncontig", [False, True])
def test_matches_reference_fp32(n_tokens, dim, vocab, chunk, ignore, noncontig):
    h, w, labels = make(n_tokens, dim, vocab, ignore=ignore, noncontig=noncontig)
    got = loss_and_grads(
        ops.linear_cross_entropy, h, w, labels, chunk_tokens=chunk, impl="fused_eager"
    )
    want = loss_and_grads(ops.linear_cross_entropy_reference, h, w, labels)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sum_reduction_and_batched_input():
    h, w, labels = make(24, 8, 30, ignore=2)
    h3, lab3 = h.detach().view(2, 12, 8).requires_grad_(True), labels.view(2, 12)
    got = ops.linear_cross_entropy(h3, w, lab3, reduction="sum", impl="fused_eager")
    want = ops.linear_cross_entropy_reference(h3, w, lab3, reduction="sum")
    torch.testing.assert_close(got, want)


def test_bf16_autocast_matches_reference():
    h, w, labels = make(40, 16, 90, ignore=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(ops.linear_cross_entropy, h, w, labels, impl="fused_eager")
        want = loss_and_grads(ops.linear_cross_entropy_reference, h, w, labels)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", ["fused_eager", "fused"])
def test_bf16_weight_gradient_in_vocab_blocks(monkeypatch, impl):
    """The low-precision ∂W update in several vocabulary blocks (a reused buffer, one
    partial last block) over several token chunks equals the float32 sum of the same
    bf16 products: each block is rounded once to bf16, as one unblocked GEMM would be."""
    from hyperloom.engine.ops import cross_entropy as ce

    h, w, labels = make(40, 16, 90, ignore=4)
    monkeypatch.setattr(ce, "GRAD_W_BLOCK_BYTES", 16 * 2 * 32)  # 32 rows of 16 bf16 a block
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, gw = loss_and_grads(
            ops.linear_cross_entropy, h, w, labels, chunk_tokens=16, impl=impl
        )
    monkeypatch.setattr(ce, "GRAD_W_BLOCK_BYTES", 2**30)  # one block
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, one = loss_and_grads(
            ops.linear_cross_entropy, h, w, labels, chunk_tokens=16, impl=impl
        )
    assert gw.dtype == torch.float32
    torch.testing.assert_close(gw, one, atol=0, rtol=0)
    # and against float32 arithmetic on the same bf16 operands, within bf16 rounding
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(ops.linear_cross_entropy_reference, h, w, labels)[2]
    torch.testing.assert_close(gw, want, atol=2e-2, rtol=2e-2)


def test_no_grad_forward_skips_the_gradients():
    h, w, labels = make(20, 8, 30)
    with torch.no_grad(), AllocationTracker() as t:
        loss = ops.linear_cross_entropy(h, w, labels, chunk_tokens=4, impl="fused_eager")
    torch.testing.assert_close(loss, ops.linear_cross_entropy_reference(h, w, labels))
    assert t.largest_bytes < w.numel() * 4  # no ∂W buffer


def test_never_allocates_the_full_logits():
    n_tokens, dim, vocab, chunk = 256, 16, 4096, 32
    h, w, labels = make(n_tokens, dim, vocab)
    full_logits = n_tokens * vocab * 4
    with AllocationTracker() as fused:
        ops.linear_cross_entropy(h, w, labels, chunk_tokens=chunk, impl="fused_eager").backward()
    with AllocationTracker() as ref:
        ops.linear_cross_entropy_reference(h, w, labels).backward()
    assert ref.largest_bytes >= full_logits  # the tracker does see the reference's logits
    assert fused.largest_bytes <= chunk * vocab * 4  # one chunk of fp32 logits at most
    assert fused.peak_bytes < 0.25 * ref.peak_bytes


def test_memory_is_measurable_on_meta_without_computing():
    h = torch.empty(8192, 4096, device="meta", requires_grad=True)
    w = torch.empty(128256, 4096, device="meta", requires_grad=True)
    labels = torch.empty(8192, dtype=torch.long, device="meta")
    with AllocationTracker() as t:
        ops.linear_cross_entropy(h, w, labels, impl="fused_eager").backward()
    chunk = ops.auto_chunk_tokens(8192, 4096, 128256)
    assert chunk == 256
    assert t.largest_bytes == w.numel() * 4  # ∂W, float32; no chunk of logits is larger


def run_ranks(world, fn):
    """Run fn(rank, all_reduce) on `world` threads whose all_reduce combines their tensors."""
    barrier = threading.Barrier(world)
    slots: list[torch.Tensor | None] = [None] * world
    results: list = [None] * world
    errors: list[BaseException] = []

    def all_reduce(rank):
        def reduce(t, op):
            slots[rank] = t.clone()
            barrier.wait()
            stacked = torch.stack(slots)  # type: ignore[arg-type]
            out = stacked.amax(0) if op == "max" else stacked.sum(0)
            barrier.wait()
            return out

        return reduce

    def worker(rank):
        try:
            results[rank] = fn(rank, all_reduce(rank))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world,chunk", [(2, 8), (3, 0)])
def test_vocab_parallel_matches_reference(world, chunk):
    n_tokens, dim, vocab = 30, 12, 24 * world
    h, w, labels = make(n_tokens, dim, vocab, ignore=3)
    shards = w.detach().chunk(world, 0)

    def rank_fn(rank, all_reduce):
        hr = h.detach().clone().requires_grad_(True)
        wr = shards[rank].clone().requires_grad_(True)
        loss = ops.linear_cross_entropy(
            hr,
            wr,
            labels,
            chunk_tokens=chunk,
            vocab_start=rank * wr.shape[0],
            all_reduce=all_reduce,
            impl="fused_eager",
        )
        (loss * 1.7).backward()
        return loss.detach(), hr.grad, wr.grad

    results = run_ranks(world, rank_fn)
    want = loss_and_grads(ops.linear_cross_entropy_reference, h, w, labels)
    for loss, _, _ in results:
        torch.testing.assert_close(loss, want[0], atol=1e-5, rtol=1e-5)
    # ∂h is each rank's partial sum (the head's copy_to_tp backward all-reduces it).
    torch.testing.assert_close(sum(r[1] for r in results), want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), want[2], atol=1e-5, rtol=1e-5)
