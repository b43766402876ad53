"""Causal (grouped-query) attention: an explicit float32 reference and the fused SDPA path.

`scaled_dot_product_attention` already dispatches to the best kernel the device has
(FlashAttention-2, cuDNN, memory-efficient, a tiled CPU kernel, or the unfused "math"
fallback), so the fused path is SDPA. This module adds a reference to hold it to and
`sdpa_backends`, which says which backend runs for given inputs, since SDPA silently falls
back to math when a backend's constraints are not met.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hyperloom.engine.ops.kernels import autocast_off, check_impl

# Best first; SDPA's own priority order on CUDA.
BACKENDS = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = True,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """softmax(q kᵀ / √d + causal mask) v in float32, for (batch, heads, seq, head_dim) inputs;
    k and v may have fewer heads (grouped-query: each serves heads/kv_heads query heads).
    `dropout_p` drops attention probabilities, as SDPA's argument does.

    Float32 also under autocast: autocast would run both matmuls in its low-precision dtype
    and round the scores to it before the softmax (as eager BF16 attention in other code
    does). That is faster on some CPUs -- 31 against SDPA's 43 ms forward + backward for
    8 x 6 heads x 256 x 64 BF16 on one core -- but then this would no longer be the yardstick
    the fused path is held to: SDPA's kernels keep the scores in float32."""
    rep = q.shape[1] // k.shape[1]
    with autocast_off(q.device):
        kf = k.float().repeat_interleave(rep, dim=1)  # (b, h, s_kv, d)
        vf = v.float().repeat_interleave(rep, dim=1)
        scores = q.float() @ kf.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, h, s, s_kv)
        if is_causal:
            s, s_kv = scores.shape[-2:]
            mask = torch.ones(s, s_kv, dtype=torch.bool, device=q.device).tril(s_kv - s)
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1)
        if dropout_p > 0:
            probs = F.dropout(probs, dropout_p)
        return (probs @ vf).to(q.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = True,
    impl: str = "fused",
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) q over k, v with the same or fewer heads;
    `dropout_p` > 0 (training only: the caller passes 0 in eval) drops attention weights."""
    check_impl(impl)
    if impl == "reference":
        return attention_reference(q, k, v, is_causal, dropout_p)
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1]
    )


def sdpa_backends(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True
) -> list[str]:
    """Names of the SDPA backends that accept these inputs, best first: the first one is
    what `attention(..., impl="fused")` runs."""
    ok = []
    gqa = k.shape[1] != q.shape[1]
    for backend in BACKENDS:
        try:
            with sdpa_kernel([backend]), torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
        except RuntimeError:
            continue
        ok.append(backend.name.lower())
    return ok


# Bytes of float32 scores per piece of query rows in the blockwise kernels below: their
# transient memory stays near a few such pieces whatever the block's length (ring attention
# at long sequences), at the cost of more, smaller matmuls.
SCORE_BYTES = 32 * 2**20


def _query_rows(q: torch.Tensor, t: int) -> int:
    """Query rows per piece: the scores (batch, heads, rows, t) of one piece in SCORE_BYTES."""
    b, h, s = q.shape[:3]
    return max(16, min(s, SCORE_BYTES // max(1, b * h * t * 4)))


def _grouped(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, int]:
    """q (b, hq, s, d) as (b, hk, g, s, d) for k with hk heads: query head h reads kv head
    h // g, as SDPA's enable_gqa does, without copying k or v per query head."""
    g = q.shape[1] // k.shape[1]
    return q.unflatten(1, (k.shape[1], g)), g


def _scores(qg: torch.Tensor, kf: torch.Tensor, scale: float, causal: bool, row0: int):
    """Scaled float32 scores (b, hk, g, rows, t) of grouped query rows [row0, row0 + rows)
    against keys kf (b, hk, t, d); causal: query row i sees keys <= i (aligned at 0)."""
    s = (qg @ kf[:, :, None].transpose(-2, -1)) * scale
    if causal:
        rows, t = s.shape[-2:]
        q_idx = torch.arange(row0, row0 + rows, device=s.device)[:, None]
        s = s.masked_fill(q_idx < torch.arange(t, device=s.device)[None, :], float("-inf"))
    return s


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether PyTorch's tiled CPU attention kernel takes these inputs: it returns the
    log-sum-exp and its backward accepts the merged one (grouped-query heads included), but
    wants one head size for q, k and v and one dtype, FP32 or BF16. Elsewhere (other devices,
    MLA's narrower v) the blocks run in the float32 math below."""
    return (
        q.device.type == "cpu"
        and q.shape[-1] == v.shape[-1]
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
    )


def attention_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of blockwise attention: (out, lse), both float32, for q (b, hq, s, d) over
    k (b, hk, t, d), v (b, hk, t, dv) with hq a multiple of hk; lse (b, hq, s) is the log of
    each row's softmax denominator, which merges blocks exactly (online softmax, Milakov &
    Gimelshein arXiv 1805.02867). Scale 1/√d, SDPA's default; `causal` aligns query i with
    key i. Ring attention's building block: SDPA's public call returns no lse, so this runs
    the CPU kernel behind it where it can (`_cpu_flash`), else the math written out here."""
    if _cpu_flash(q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out.float(), lse
    with autocast_off(q.device):
        qg, _ = _grouped(q.float(), k)
        kf, vf = k.float(), v.float()
        scale = 1.0 / math.sqrt(q.shape[-1])
        outs, lses, rows = [], [], _query_rows(q, k.shape[2])
        for r0 in range(0, q.shape[2], rows):
            s = _scores(qg[..., r0 : r0 + rows, :], kf, scale, causal, r0)
            lse = torch.logsumexp(s, dim=-1)  # (b, hk, g, rows)
            outs.append(torch.exp(s - lse[..., None]) @ vf[:, :, None])
            lses.append(lse)
        out = torch.cat(outs, dim=-2).flatten(1, 2)  # (b, hq, s, dv)
        return out, torch.cat(lses, dim=-1).flatten(1, 2)


def attention_block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv), float32, of one block's share of an attention whose rows have
    the merged output `out` (b, hq, s, dv) and log-sum-exp `lse` (b, hq, s) over every block:
    with P = exp(S - lse) and delta = rowsum(dO * out), dV = Pᵀ dO, dS = P (dO Vᵀ - delta),
    dQ = dS K / √d, dK = dSᵀ Q / √d (FlashAttention-2's backward, Dao arXiv 2307.08691 §3.1).
    `out` and `dout` in q's dtype for the CPU kernel (`_cpu_flash`)."""
    if _cpu_flash(q, k, v):
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grads = kernel(dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal)
        return tuple(g.float() for g in grads)
    with autocast_off(q.device):
        qg, g = _grouped(q.float(), k)
        kf, vf = k.float(), v.float()
        dog, _ = _grouped(dout.float(), k)
        delta = (dout.float() * out.float()).sum(-1)
        lse_g, delta_g = lse.unflatten(1, (k.shape[1], g)), delta.unflatten(1, (k.shape[1], g))
        scale = 1.0 / math.sqrt(q.shape[-1])
        dk, dv, dqs = torch.zeros_like(kf), torch.zeros_like(vf), []
        step = _query_rows(q, k.shape[2])
        for r0 in range(0, q.shape[2], step):
            rows = slice(r0, r0 + step)
            qr, dor = qg[..., rows, :], dog[..., rows, :]
            p = torch.exp(_scores(qr, kf, scale, causal, r0) - lse_g[..., rows, None])
            dv += (p.transpose(-2, -1) @ dor).sum(2)  # over the query heads of each kv head
            ds = p * (dor @ vf[:, :, None].transpose(-2, -1) - delta_g[..., rows, None])
            dqs.append((ds @ kf[:, :, None]) * scale)
            dk += (ds.transpose(-2, -1) @ qr).sum(2) * scale
        return torch.cat(dqs, dim=-2).flatten(1, 2), dk, dv
