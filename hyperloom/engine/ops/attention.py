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
