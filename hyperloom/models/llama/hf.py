"""Hugging Face `transformers` interop for the Llama family: config and state-dict names.

hyperloom's RoPE pairs channels as `LlamaForCausalLM` does, so weights map one to one by name.
A model with `model.qk_norm` exports as `Qwen3ForCausalLM`, and a Qwen3 directory imports as a
Llama with qk_norm; Qwen3 checkpoints with a decoupled head_dim, biases or sliding windows are
refused. `transformers` is optional (`pip install hyperloom[hf]`) and imported lazily.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from hyperloom.config import ModelConfig

# hyperloom name pattern -> Hugging Face name pattern ({i} = layer index).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # model.qk_norm, Qwen3's names
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _rename(name: str, top: dict, layer_re: re.Pattern, layer: dict, prefix: str, what: str) -> str:
    if name in top:
        return top[name]
    m = layer_re.match(name)
    if m and m.group(2) in layer:
        return f"{prefix}{m.group(1)}.{layer[m.group(2)]}"
    raise KeyError(f"no {what} name for parameter '{name}'")


def to_hf_name(name: str) -> str:
    return _rename(name, _TOP_NAMES, _OURS_LAYER, _LAYER_NAMES, "model.layers.", "Hugging Face")


def from_hf_name(name: str) -> str:
    top = {v: k for k, v in _TOP_NAMES.items()}
    layer = {v: k for k, v in _LAYER_NAMES.items()}
    return _rename(name, top, _HF_LAYER, layer, "layers.", "hyperloom")


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {to_hf_name(k): v for k, v in state.items()}


def from_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face Llama state dict; drops rotary buffers and a tied lm_head."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue
        out[from_hf_name(name)] = tensor
    return out


def hf_config(cfg: ModelConfig) -> Any:
    """A `transformers.LlamaConfig` describing the same architecture (`Qwen3Config` with
    model.qk_norm)."""
    from transformers import LlamaConfig, Qwen3Config

    rope: dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_scaling > 1:
        rope = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq,
        }
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        hidden_act="silu",
    )
    config_class = LlamaConfig
    if cfg.qk_norm:
        config_class = Qwen3Config
        kwargs.update(
            head_dim=cfg.dim // cfg.n_heads, attention_bias=False, use_sliding_window=False
        )
    if "rope_parameters" in inspect.signature(config_class.__init__).parameters:
        kwargs["rope_parameters"] = {**rope, "rope_theta": cfg.rope_theta}  # transformers >= 5
    else:
        kwargs["rope_theta"] = cfg.rope_theta
        kwargs["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    return config_class(**kwargs)


def hf_rope_and_common(hf: Any, scaled_type: str, original: int) -> tuple[dict, dict[str, Any]]:
    """The RoPE parameters of a Hugging Face config (transformers 5 `rope_parameters` or 4
    `rope_scaling`) and the model-section values every family reads the same way."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    scaled = rope.get("rope_type", rope.get("type", "default")) == scaled_type
    return rope, {
        "vocab_size": hf.vocab_size,
        "dim": hf.hidden_size,
        "n_layers": hf.num_hidden_layers,
        "ffn_dim": hf.intermediate_size,
        "norm_eps": hf.rms_norm_eps,
        "rope_theta": float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
        "rope_scaling": float(rope.get("factor", 1.0)) if scaled else 1.0,
        "rope_original_max_seq": int(rope.get("original_max_position_embeddings", original)),
        "max_seq_len": hf.max_position_embeddings,
        "tie_embeddings": bool(hf.tie_word_embeddings),
        "init_std": hf.initializer_range,
    }


def config_from_hf(hf: Any) -> dict[str, Any]:
    """Model-section values (family llama) from a `LlamaConfig`- or `Qwen3Config`-like object.
    Raises ValueError, naming the field, for what this model cannot represent."""
    rope, common = hf_rope_and_common(hf, "llama3", 8192)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and head_dim * heads != hf.hidden_size:
        raise ValueError(
            f"head_dim {head_dim} is not hidden_size / num_attention_heads "
            f"({hf.hidden_size} / {heads}); this model derives head_dim from them"
        )
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ValueError("attention_bias / mlp_bias = true: this model's linears have no bias")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("use_sliding_window = true: this model attends over the whole context")
    return {
        "family": "llama",
        "qk_norm": getattr(hf, "model_type", "llama") == "qwen3",
        **common,
        "n_heads": heads,
        "n_kv_heads": getattr(hf, "num_key_value_heads", None) or heads,
        "rope_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
        "rope_high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
    }
