"""A plain PyTorch Llama: the baseline hyperloom's training throughput is measured against.

This is what a competent engineer writes without a framework, in one file: `nn.Linear`
projections, `nn.RMSNorm`, half-split RoPE from precomputed tables, grouped-query attention
through `scaled_dot_product_attention(enable_gqa=True)`, SwiGLU. It shares no code with
hyperloom on purpose -- only the parameter names are chosen to match Meta's reference
(`tok_embeddings`, `layers.N.attention.wq`, ...) so hyperloom's initial weights load by name
for the parity check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (b, h, s, d)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (b, kv, s, d)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        # enable_gqa lets each kv head serve n_heads / n_kv_heads query heads without copying.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (b, s, h * d)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, eps: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)
        self.feed_forward = FeedForward(dim, ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel i with channel i + d/2 (the Hugging Face pairing); x is (b, h, s, d)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).type_as(x)  # tables are fp32: angles stay exact in bf16


class PlainLlama(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_dim: int,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        max_seq_len: int = 2048,
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            Block(dim, n_heads, n_kv_heads, ffn_dim, norm_eps) for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        head_dim = dim // n_heads
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2).double() / head_dim)
        angles = torch.outer(torch.arange(max_seq_len).double(), inv_freq)  # (seq, d/2)
        angles = torch.cat([angles, angles], dim=-1)  # (seq, d)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]  # (s, d), broadcast over (b, h, s, d)
        h = self.tok_embeddings(tokens)  # (b, s, dim)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))  # (b, s, vocab)
