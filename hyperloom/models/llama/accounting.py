"""Closed-form parameter and FLOP counts for the Llama family (no model is materialised).

Training FLOPs per token follow Megatron-LM and PaLM (arXiv 2204.02311, appendix B): 6 per
matmul weight plus the attention score and value products, 12 · n_layers · seq_len · dim,
over the full (not causally halved) matrix; embeddings and norms are not counted. MFU is
these model FLOPs per second over the peak; recomputation does not add to it.
"""

from __future__ import annotations

from hyperloom.config import ModelConfig


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters."""
    head_dim = cfg.dim // cfg.n_heads
    attn = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)  # wq, wo, wk, wv
    ffn = 3 * cfg.dim * cfg.ffn_dim  # w1, w2, w3
    norms = 2 * cfg.dim + (2 * head_dim if cfg.qk_norm else 0)  # block norms, q/k norms
    embed = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    return cfg.n_layers * (attn + ffn + norms) + cfg.dim + embed


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every linear plus the output head."""
    head_dim = cfg.dim // cfg.n_heads
    attn = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    return cfg.n_layers * (attn + 3 * cfg.dim * cfg.ffn_dim) + cfg.vocab_size * cfg.dim


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token at sequence length `seq_len`."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * seq_len * cfg.dim
