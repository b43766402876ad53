"""Cross-entropy fused with the output projection, in chunks of tokens (and vocab-parallel).

The reference materialises the (tokens, vocab) logits -- 4 GiB in float32 for 8k x 128k --
plus copies for backward. The fused operator holds one chunk of logits at a time
(Liger-Kernel's FusedLinearCrossEntropy; "Cut Your Losses", arXiv 2411.09009, goes further):

    for each chunk of c tokens:
        z = h_c Wᵀ                                   (c, vocab), the only large temporary
        m = max z,  s = Σ exp(z − m),  loss_c = log s − (z_target − m)
        ∂z = (softmax(z) − onehot(target)) / n_valid (0 for ignored tokens)
        ∂h_c = ∂z W,   ∂W += ∂zᵀ h_c

so forward computes both gradients and backward only scales them (one backward per forward).
The chunk defaults to Liger's rule, c ≈ tokens · dim / vocab rounded to a power of two.

Vocab-parallel (Megatron): each rank holds a slice of W's rows; the only cross-rank values are
per token (the max, the sum of exponentials, the target's logit), reduced through an
`all_reduce(tensor, op)` callback, so the engine knows no process groups. Matmuls run in the
autocast dtype, the softmax in float32, ∂W accumulates in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hyperloom.engine.ops.kernels import autocast_off, check_impl, kernel

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]  # (tensor, "max" | "sum") -> reduced


REDUCTIONS = ("mean", "sum", "sample_mean")


def token_weights(labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """Each token's weight in the reduced loss, float32 (tokens,), zero where ignored.

    "mean": 1 / (valid tokens); "sum": 1; "sample_mean": each row (sample) of labels
    (..., seq) averaged over its own valid tokens, then the rows averaged. A sample's weight
    then does not depend on which others share its batch, so a micro-batch's mean of sample
    means gives the same global mean for any split of the rows (pipeline, data parallel)
    when answers -- the labelled tokens of a conversation -- differ in length."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    valid = (labels != ignore_index).float()
    if reduction == "sum":
        return valid.reshape(-1)
    if reduction == "mean":
        return (valid / valid.sum().clamp(min=1)).reshape(-1)
    rows = valid.reshape(-1, labels.shape[-1])  # (samples, seq)
    per_row = rows / rows.sum(-1, keepdim=True).clamp(min=1)
    return (per_row / rows.shape[0]).reshape(-1)


def cross_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Float32 cross-entropy of logits (..., vocab) against labels (...)."""
    flat = logits.float().reshape(-1, logits.shape[-1])  # (tokens, vocab)
    if reduction == "sample_mean":
        losses = F.cross_entropy(
            flat, labels.reshape(-1), ignore_index=ignore_index, reduction="none"
        )
        return (losses * token_weights(labels, ignore_index, reduction)).sum()
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction=reduction)


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Plain PyTorch: full logits `hidden @ weight.T`, then `cross_entropy_reference`."""
    return cross_entropy_reference(F.linear(hidden, weight), labels, ignore_index, reduction)


MIN_CHUNK_TOKENS = 256  # below this, per-chunk overhead and thin matmuls cost more than memory


def auto_chunk_tokens(n_tokens: int, dim: int, vocab: int) -> int:
    """Liger's rule, chunks of ~tokens·dim/vocab tokens rounded up to a power of two, but at
    least MIN_CHUNK_TOKENS (measured on CPU: 64-token chunks of a 16k vocabulary ran 1.6x
    slower than 256-token ones, which cost 16 MiB of float32 logits)."""
    per_chunk = -(-n_tokens // max(1, -(-vocab // dim)))  # ceil(n / ceil(vocab / dim))
    return max(MIN_CHUNK_TOKENS, 1 << (per_chunk - 1).bit_length())


@kernel
def _sumexp_target(z: torch.Tensor, m: torch.Tensor, idx: torch.Tensor, inside: torch.Tensor):
    zf = z.float()  # (c, vocab)
    s = torch.exp(zf - m[:, None]).sum(-1)
    target = zf.gather(1, idx[:, None]).squeeze(1) - m
    return s, torch.where(inside, target, torch.zeros_like(target))


@kernel
def _logit_grad(z, m, s, idx, inside, row_scale):
    # (softmax - onehot) * row_scale with one float32 (c, vocab) buffer, updated in place.
    g = z.float() - m[:, None]  # (c, vocab)
    g.exp_().mul_((row_scale / s)[:, None])
    g.scatter_add_(1, idx[:, None], -(row_scale * inside)[:, None])
    return g.to(z.dtype)


GRAD_W_BLOCK_BYTES = 128 * 2**20  # bound on the temporary of a low-precision ∂W update


@kernel
def _add_into(acc: torch.Tensor, x: torch.Tensor) -> None:
    # float32 += low precision in one pass; eager PyTorch first copies x to a float32
    # temporary (measured on CPU at a (16384, 384) block: 10 ms compiled vs 35 ms eager for
    # the product and the add together).
    acc.add_(x.to(acc.dtype))


def _accumulate_grad_w(
    grad_w: torch.Tensor,
    dz: torch.Tensor,
    hk: torch.Tensor,
    buf: torch.Tensor | None = None,
    impl: str = "fused",
) -> torch.Tensor | None:
    """grad_w (vocab, dim) float32 += dzᵀ hk, without a (vocab, dim) float32 temporary.

    Same dtype: one in-place addmm. Low-precision dz/hk (autocast): the product is formed a
    block of vocabulary rows at a time into `buf` (low precision, reused across chunks so
    the chunks do not each fault in fresh pages) and added in float32 (CPU has no
    mixed-dtype addmm). `dz[:, rows]ᵀ` is a valid strided GEMM operand, so no transposed
    copy of dz is made. Returns the buffer for the next chunk.
    """
    if dz.dtype == grad_w.dtype:
        grad_w.addmm_(dz.T, hk)
        return buf
    vocab, dim = grad_w.shape
    rows = min(vocab, max(1, GRAD_W_BLOCK_BYTES // (dim * dz.element_size())))
    if buf is None or buf.shape != (rows, dim) or buf.dtype != dz.dtype:
        buf = torch.empty(rows, dim, dtype=dz.dtype, device=dz.device)
    for v0 in range(0, vocab, rows):
        v1 = min(v0 + rows, vocab)
        out = buf[: v1 - v0]
        torch.mm(dz[:, v0:v1].T, hk, out=out)  # (rows, dim) in the low precision
        _add_into(grad_w[v0:v1], out, impl=impl)
    return buf


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, opts):
        ignore_index, chunk, vocab_start, all_reduce, cdt, reduction, need_grad, impl = opts
        dim, vocab = hidden.shape[-1], weight.shape[0]
        h = hidden.reshape(-1, dim)  # (tokens, dim)
        lab = labels.reshape(-1)  # (tokens,)
        n = h.shape[0]
        valid = lab != ignore_index
        n_valid = valid.sum().clamp(min=1).float()
        scale = 1.0 / n_valid if reduction == "mean" else torch.ones((), device=h.device)
        # sample_mean: a weight per token (scale stays 1); mean and sum: one scale
        weights = (
            token_weights(labels, ignore_index, reduction) if reduction == "sample_mean" else None
        )
        with autocast_off(h.device):
            hc, wc = h.to(cdt), weight.to(cdt)
            grad_h = torch.empty_like(h) if need_grad and hidden.requires_grad else None
            grad_w = None
            if need_grad and weight.requires_grad:
                grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            buf = None  # the low-precision ∂W block, reused by every chunk
            for start in range(0, n, chunk):
                hk = hc[start : start + chunk]  # (c, dim)
                z = hk @ wc.T  # (c, vocab), one chunk of logits
                local = lab[start : start + chunk] - vocab_start
                ok = valid[start : start + chunk]
                inside = (local >= 0) & (local < vocab) & ok
                idx = local.clamp(0, vocab - 1)
                m = z.amax(-1).float()  # (c,)
                if all_reduce is not None:
                    m = all_reduce(m, "max")
                s, target = _sumexp_target(z, m, idx, inside, impl=impl)
                if all_reduce is not None:
                    s, target = all_reduce(torch.stack([s, target]), "sum").unbind(0)
                token_loss = torch.where(ok, s.log() - target, torch.zeros_like(s))
                if weights is None:
                    loss += token_loss.sum()
                    row_scale = ok.float() * scale
                else:
                    row_scale = weights[start : start + chunk]
                    loss += (token_loss * row_scale).sum()
                if grad_h is None and grad_w is None:
                    continue
                dz = _logit_grad(z, m, s, idx, inside, row_scale, impl=impl)  # (c, vocab)
                del z
                if grad_h is not None:
                    grad_h[start : start + chunk] = dz @ wc  # (c, dim)
                if grad_w is not None:
                    buf = _accumulate_grad_w(grad_w, dz, hk, buf, impl)
        # Kept as plain attributes, not save_for_backward: backward hands over the only
        # reference, so autograd can adopt ∂W as weight.grad instead of copying 2 GiB.
        ctx.grads = (grad_h, grad_w)
        ctx.shape, ctx.w_dtype = hidden.shape, weight.dtype
        return loss * scale

    @staticmethod
    def backward(ctx, dloss):
        grad_h, grad_w = ctx.grads
        del ctx.grads
        # In place: these buffers belong to this one forward (no retain_graph double backward).
        dh = None if grad_h is None else grad_h.mul_(dloss.to(grad_h.dtype)).view(ctx.shape)
        dw = None if grad_w is None else grad_w.mul_(dloss).to(ctx.w_dtype)
        return dh, dw, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_tokens: int = 0,
    vocab_start: int = 0,
    all_reduce: AllReduce | None = None,
    impl: str = "fused",
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` (..., vocab) against `labels` (...), float32.

    `weight` (vocab, dim) may be this rank's vocabulary slice starting at `vocab_start`; then
    `all_reduce(t, "max" | "sum")` must reduce per-token tensors over the ranks that hold the
    other slices. `chunk_tokens` = 0 picks the chunk size automatically. `reduction` is
    "mean" (over tokens whose label is not `ignore_index`), "sum" or "sample_mean" (each
    row's mean, averaged over rows: `token_weights`).
    """
    check_impl(impl)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if impl == "reference" and all_reduce is None:
        return linear_cross_entropy_reference(hidden, weight, labels, ignore_index, reduction)
    n = hidden.numel() // hidden.shape[-1]
    chunk = chunk_tokens or auto_chunk_tokens(n, hidden.shape[-1], weight.shape[0])
    dev = hidden.device.type
    autocast = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
    cdt = torch.get_autocast_dtype(dev) if autocast else hidden.dtype
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    # Vocab-parallel has no unchunked reference: there "reference" runs the kernels eagerly.
    kernels = "fused_eager" if impl == "reference" else impl
    opts = (
        ignore_index,
        chunk,
        vocab_start,
        all_reduce,
        cdt,
        reduction,
        need_grad,
        kernels,
    )
    return _LinearCrossEntropy.apply(hidden, weight, labels, opts)
