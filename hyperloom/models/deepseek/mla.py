"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434 §2.1) and its compressed cache.

Queries come from a low-rank path wq_a → RMSNorm → wq_b (or one wq), split into q_nope and
q_pe. Keys and values come from one latent: wkv_a gives c_kv (RMS-normalised) and k_pe, a
single RoPE key shared by every head; wkv_b expands c_kv into k_nope and v. Names follow
DeepSeek's `inference/model.py`. Training materialises k and v per head and runs causal SDPA.

**Absorbed decode** (V2 §2.1.2). The cache holds only [c_kv ‖ k_pe] per token (576 values for
V3). With W_UK, W_UV the k_nope and v slices of wkv_b,

    q_nope · k_nope = (q_nope W_UK) · c_kv,    Σ_t p_t v_t = W_UV (Σ_t p_t c_kv,t)

so attention runs in the latent space and keys/values are never expanded; it equals the
training path up to rounding (tested).

**RoPE scaling** (`model.rope_kind`; YaRN by default, arXiv 2309.00071, DeepSeek-V3's
`precompute_freqs_cis`): the tables come from `rope_tables_of`. Stretched positions flatten
the softmax, so under any scaling the softmax scale gets mscale², mscale = 0.1 · `yarn_mscale`
· ln s + 1 (DeepSeek's `mscale_all_dim`; Hugging Face's `yarn_apply_mscale`).

**Latent norms.** The query and key/value latents are RMS-normalised with ε = 1e-6 whatever
`norm_eps` says: DeepSeek's reference (`RMSNorm(q_lora_rank)`, default eps 1e-6) and
transformers' `DeepseekV3RMSNorm` default both build them so, and only the block norms read
`rms_norm_eps`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hyperloom.config import ModelConfig
from hyperloom.engine import ops
from hyperloom.engine.ops import OpImpls
from hyperloom.models.llama.model import CoreAttention, RMSNorm, rope_window

# The latent RMSNorms' epsilon (see the module doc).
LATENT_NORM_EPS = 1e-6


def yarn_correction(cfg: ModelConfig) -> float:
    """mscale² when RoPE scaling stretches the context (rope_scaling > 1), else 1."""
    if cfg.rope_kind == "default":
        return 1.0
    mscale = 0.1 * cfg.yarn_mscale * math.log(cfg.rope_scaling) + 1.0
    return mscale * mscale


def softmax_scale(cfg: ModelConfig) -> float:
    """(nope + rope)^-½ · mscale²."""
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * yarn_correction(cfg)


@dataclass
class MLACache:
    """Compressed cache for absorbed decoding: per layer c_kv (batch, max_len, kv_lora_rank)
    and the shared, already-rotated k_pe (batch, max_len, rope_dim); [0, length) filled."""

    kv: list[torch.Tensor]
    pe: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        n_layers: int,
        batch: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> MLACache:
        def zeros(width: int) -> list[torch.Tensor]:
            return [
                torch.zeros(batch, max_len, width, device=device, dtype=dtype)
                for _ in range(n_layers)
            ]

        return cls(kv=zeros(cfg.kv_lora_rank), pe=zeros(cfg.qk_rope_head_dim))

    @property
    def max_len(self) -> int:
        return self.kv[0].shape[1]

    def update(
        self, layer: int, start: int, kv: torch.Tensor, pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write positions [start, start + seq) and return everything cached so far."""
        end = start + kv.shape[1]
        self.kv[layer][:, start:end] = kv
        self.pe[layer][:, start:end] = pe
        return self.kv[layer][:, :end], self.pe[layer][:, :end]


class UpAndCore(nn.Module):
    """MLA's up-projections, query RoPE and attention core as one module with no weights of
    its own (it runs the `MLA` handed to it), so that the recompute slot can checkpoint them
    together: "mla_up" keeps the latents and drops the per-head q, k and v (Megatron's
    mla_up_proj recompute)."""

    def forward(self, mla: MLA, q_in, c_kv, k_pe, cos, sin) -> torch.Tensor:
        return mla.up_and_core(q_in, c_kv, k_pe, cos, sin)


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_rank = cfg.kv_lora_rank
        q_out = cfg.n_heads * (self.nope + self.rope_dim)
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, q_out, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        self.scale = softmax_scale(cfg)
        self.q_scale = yarn_correction(cfg)  # folded into q on the SDPA path
        self.core_attention = CoreAttention(cfg.dropout)  # dropout on the weights, training
        self.up_core = UpAndCore()  # the recompute slot's "mla_up" region
        self.ops = OpImpls()

    def _q_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the query up-projection reads: the normed query latent (or x for one wq)."""
        return x if hasattr(self, "wq") else self.q_norm(self.wq_a(x))

    def _queries(self, q_in: torch.Tensor) -> torch.Tensor:
        q = self.wq(q_in) if hasattr(self, "wq") else self.wq_b(q_in)
        # Heads from the width: a tensor-parallel rank holds n_heads / tp of them.
        return q.unflatten(-1, (-1, self.nope + self.rope_dim))  # (b, s, heads, nope + rope)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: MLACache | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = rope_window(cos, sin, s, self.core_attention.context)  # (s, rope_dim)
        q_in = self._q_input(x)
        c_kv, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_norm(c_kv)  # (b, s, kv_rank)
        if cache is not None:
            q = ops.rope(self._queries(q_in), cos, sin, self.ops.rope)
            k_pe = ops.rope(k_pe[:, :, None], cos, sin, self.ops.rope)  # (b, s, 1, rope)
            return self._absorbed(q, c_kv, k_pe[:, :, 0], cache, start_pos)
        return self.wo(self.up_core(self, q_in, c_kv, k_pe, cos, sin))  # (b, s, heads * v)

    def up_and_core(self, q_in, c_kv, k_pe, cos, sin) -> torch.Tensor:
        """The up-projections (wq_b or wq, wkv_b), RoPE and the attention core: (b, s,
        heads * v_head_dim), what wo reads. RoPE runs in here so that a checkpoint of it keeps
        k_pe as the slice of wkv_a's output that is kept anyway."""
        q = ops.rope(self._queries(q_in), cos, sin, self.ops.rope)  # rotates the trailing q_pe
        k_pe = ops.rope(k_pe[:, :, None], cos, sin, self.ops.rope)  # (b, s, 1, rope)
        # SDPA wants (b, heads, s, d); its default scale is (nope + rope)^-½, so the YaRN
        # correction is folded into the queries.
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q = q.transpose(1, 2)
        context = self.core_attention.context
        if context is not None and context.comm == "ring" and not self._wkv_b_fp8():
            # The ring passes the compressed latent, not per-head K/V (context_parallel).
            latent = torch.cat([c_kv, k_pe[:, :, 0]], dim=-1)  # (b, s, kv_rank + rope)
            out = context.latent_attention(q, latent, self._expand_latent, (self.wkv_b.weight,))
        else:
            out = self.core_attention(q, *self._expand(c_kv, k_pe[:, :, 0]))
        return out.transpose(1, 2).flatten(2)

    def _expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_expand` of a ring block [c_kv ‖ rotated k_pe] (b, s, kv_rank + rope)."""
        return self._expand(*latent.split([self.kv_rank, self.rope_dim], dim=-1))

    def _expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv (b, s, kv_rank) and the rotated k_pe (b, s, rope) -> K (b, heads, s, nope + rope)
        and V (b, heads, s, v_head_dim): wkv_b's up-projection, one k_pe for all heads."""
        kv = self.wkv_b(c_kv).unflatten(-1, (-1, self.nope + self.v_dim))  # (b, s, heads, nope + v)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _wkv_b_fp8(self) -> bool:
        """wkv_b runs in FP8: the latent ring would call it cp times per pass, each recording
        its amaxes, so that ring passes per-head K/V instead."""
        return any(hasattr(m, "fp8_amax_history") for m in self.wkv_b.modules())

    def _absorbed(
        self,
        q: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        cache: MLACache,
        start_pos: int,
    ) -> torch.Tensor:
        """Attention in the latent space over the compressed cache (see the module doc)."""
        s = q.shape[1]
        c_kv, k_pe = cache.update(self.layer_id, start_pos, c_kv, k_pe)  # (b, t, rank), (b, t, r)
        w = self.wkv_b.weight.unflatten(0, (-1, self.nope + self.v_dim))  # (heads, nope + v, rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w_uk.to(q.dtype))  # (b, s, heads, rank)
        scores = torch.einsum("bshc,btc->bsht", q_lat, c_kv.to(q.dtype))
        scores = scores + torch.einsum("bshr,btr->bsht", q_pe, k_pe.to(q.dtype))
        scores = scores.float() * self.scale  # (b, s, heads, t)
        t = c_kv.shape[1]
        q_pos = torch.arange(start_pos, start_pos + s, device=q.device)
        visible = q_pos[:, None] >= torch.arange(t, device=q.device)[None, :]  # (s, t)
        scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
        p = scores.softmax(-1).to(q.dtype)
        o_lat = torch.einsum("bsht,btc->bshc", p, c_kv.to(q.dtype))  # (b, s, heads, rank)
        out = torch.einsum("bshc,hdc->bshd", o_lat, w_uv.to(q.dtype))  # (b, s, heads, v)
        return self.wo(out.flatten(2))  # (b, s, heads * v) -> (b, s, dim)
