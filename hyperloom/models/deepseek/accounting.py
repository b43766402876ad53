"""Closed-form parameter and FLOP counts for the DeepSeek family (no model is materialised).

`param_count` is every parameter held (main model, MTP modules, balancing biases);
`main_param_count` leaves out MTP, which is DeepSeek's published "total" (671B for V3);
`active_param_count` is what one token passes through in the main model (attention, dense
FFNs, router, top-k routed and shared experts, norms, head; not the embedding lookup), the
published "activated" (37B for V3). Training FLOPs follow the Llama family's convention: 6 per
matmul weight touched per token (MTP included) plus the full, not causally halved, attention
products, 3 · 2 · seq · heads · (qk_dim + v_dim) per layer.
"""

from __future__ import annotations

from hyperloom.config import ModelConfig


def _attention(c: ModelConfig) -> int:
    q_dim = c.n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    if c.q_lora_rank:
        q = c.dim * c.q_lora_rank + c.q_lora_rank * q_dim  # wq_a, wq_b
    else:
        q = c.dim * q_dim
    kv = c.dim * (c.kv_lora_rank + c.qk_rope_head_dim)  # wkv_a
    kv += c.kv_lora_rank * c.n_heads * (c.qk_nope_head_dim + c.v_head_dim)  # wkv_b
    return q + kv + c.n_heads * c.v_head_dim * c.dim  # + wo


def _attention_norms(c: ModelConfig) -> int:
    return (c.q_lora_rank if c.q_lora_rank else 0) + c.kv_lora_rank


def _expert(c: ModelConfig) -> int:
    return 3 * c.dim * c.moe_ffn_dim


def _layer(c: ModelConfig, moe: bool, routed: int) -> int:
    """Matmul weights of one block with `routed` experts counted (norms excluded)."""
    if not moe:
        return _attention(c) + 3 * c.dim * c.ffn_dim
    router = c.n_routed_experts * c.dim
    return _attention(c) + router + (routed + c.n_shared_experts) * _expert(c)


def _n_moe(c: ModelConfig) -> int:
    return (c.n_layers - c.n_dense_layers) if c.n_routed_experts else 0


def _block_extras(c: ModelConfig, moe: bool) -> int:
    """Norm weights of a block and the expert bias."""
    return 2 * c.dim + _attention_norms(c) + (c.n_routed_experts if moe else 0)


def _main(c: ModelConfig, routed: int) -> int:
    n_moe = _n_moe(c)
    n_dense = c.n_layers - n_moe
    layers = n_dense * (_layer(c, False, 0) + _block_extras(c, False))
    layers += n_moe * (_layer(c, True, routed) + _block_extras(c, True))
    embed = c.vocab_size * c.dim * (1 if c.tie_embeddings else 2)
    return layers + c.dim + embed


def _mtp_module(c: ModelConfig, routed: int) -> int:
    moe = bool(c.n_routed_experts)
    merge = 2 * c.dim * c.dim + 3 * c.dim  # eh_proj, enorm, hnorm, its final norm
    return _layer(c, moe, routed) + _block_extras(c, moe) + merge


def main_param_count(cfg: ModelConfig) -> int:
    """The main model's parameters (DeepSeek's published "total")."""
    return _main(cfg, cfg.n_routed_experts)


def mtp_param_count(cfg: ModelConfig) -> int:
    """Parameters of the MTP modules (embedding and head are shared, not counted)."""
    return cfg.mtp_depth * _mtp_module(cfg, cfg.n_routed_experts)


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of the module: main model plus MTP."""
    return main_param_count(cfg) + mtp_param_count(cfg)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses in the main model, the input embedding (a lookup, not a
    matmul) excluded: DeepSeek's published "activated" (V3: 36.6B, published as 37B)."""
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return _main(cfg, cfg.moe_top_k) - lookup


def matmul_params(cfg: ModelConfig) -> int:
    """Weights in a matmul per trained token: main model and MTP, top-k experts, the head
    (once per prediction depth)."""
    c, k = cfg, cfg.moe_top_k
    n_moe = _n_moe(c)
    main = (c.n_layers - n_moe) * _layer(c, False, 0) + n_moe * _layer(c, True, k)
    mtp = c.mtp_depth * (_layer(c, bool(c.n_routed_experts), k) + 2 * c.dim * c.dim)
    return main + mtp + (1 + c.mtp_depth) * c.vocab_size * c.dim


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token at sequence length `seq_len`."""
    c = cfg
    per_layer = 6 * seq_len * c.n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    return 6 * matmul_params(c) + (c.n_layers + c.mtp_depth) * per_layer
