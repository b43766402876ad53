"""Hugging Face `transformers` interop for the Llama family: config and state-dict names, and the
config readings every family shares (RoPE scaling, the checks on keys no family represents).

hyperloom's RoPE pairs channels as `LlamaForCausalLM` does, so weights map one to one by name.
A model with `model.qk_norm` exports as `Qwen3ForCausalLM`, and a Qwen3 directory imports as a
Llama with qk_norm. RoPE scaling maps both ways for the kinds the model implements (linear,
llama3, yarn; `model.rope_type`), YaRN's attention factor computed as transformers'
`_compute_yarn_parameters` does. What the model cannot be is refused by the key's name: another
activation, biases, attention dropout, a decoupled head_dim, sliding windows, dynamic or
long-RoPE scaling, partial rotary, quantized weights. `transformers` is optional
(`pip install hyperloom[hf]`) and imported lazily.
"""

from __future__ import annotations

import inspect
import math
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

# RoPE scaling kinds the model implements (model.rope_type), by their Hugging Face names.
ROPE_KINDS = ("default", "linear", "llama3", "yarn")


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


# --------------------------------------------------------------------------- RoPE


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' `rope_parameters` for the model's RoPE (`cfg.rope_kind`). YaRN's attention
    factor is written out, so transformers need not infer it from mscale; a DeepSeek model also
    carries `mscale_all_dim` (= yarn_mscale), which scales MLA's softmax under any scaling."""
    kind = cfg.rope_kind
    rope: dict[str, Any] = {"rope_type": kind, "rope_theta": cfg.rope_theta}
    if kind == "default":
        return rope
    rope["factor"] = cfg.rope_scaling
    if kind == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_seq,
        )
    elif kind == "yarn":
        rope.update(
            original_max_position_embeddings=cfg.rope_original_max_seq,
            beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow,
            attention_factor=cfg.rope_attention_factor,
        )
    if cfg.decoder_family == "deepseek":
        rope["mscale_all_dim"] = cfg.yarn_mscale
        if kind == "yarn":  # DeepSeek's own configs carry both, equal
            rope["mscale"] = cfg.yarn_mscale
    return rope


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 · mscale · ln s + 1 (arXiv 2309.00071 eq. 21), 1 for s <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_from_hf(hf: Any, deepseek: bool) -> dict[str, Any]:
    """Model values for the RoPE of a config (transformers 5 `rope_parameters`, or 4's
    `rope_theta` + `rope_scaling`). YaRN's attention factor follows transformers: the explicit
    `attention_factor`, else mscale(s, mscale) / mscale(s, mscale_all_dim) when both are set,
    else mscale(s); kept at 0 (the family default) when it equals that default. ValueError
    naming the key for a kind or parameter the model does not implement."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    if kind not in ROPE_KINDS:
        raise ValueError(
            f"rope_parameters.rope_type = {kind!r} is not supported (dynamic and long-RoPE "
            f"scaling change with the sequence); supported: {', '.join(ROPE_KINDS)}"
        )
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"partial_rotary_factor = {partial}: this model rotates the whole rope width"
        )
    out: dict[str, Any] = {"rope_theta": theta}
    if kind == "default":
        return out
    original = rope.get("original_max_position_embeddings")
    if rope.get("factor") is None:
        raise ValueError(f"rope_parameters: rope_type {kind!r} needs a factor")
    factor = float(rope["factor"])
    auto = "yarn" if deepseek else "llama3"
    out.update(rope_scaling=factor, rope_type="auto" if kind == auto else kind)
    if kind in ("llama3", "yarn"):  # the context the ramp is measured in
        if original is None:
            raise ValueError(
                f"rope_parameters: rope_type {kind!r} needs original_max_position_embeddings"
            )
        out["rope_original_max_seq"] = int(original)
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(rope.get("low_freq_factor", 1.0))
        out["rope_high_freq_factor"] = float(rope.get("high_freq_factor", 4.0))
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if kind == "yarn":
        if rope.get("truncate", True) is False:
            raise ValueError(
                "rope_parameters.truncate = false: this model's YaRN ramp uses whole dimensions"
            )
        # transformers reads them with `or`: 0 or null means the default
        out["yarn_beta_fast"] = float(rope.get("beta_fast") or 32.0)
        out["yarn_beta_slow"] = float(rope.get("beta_slow") or 1.0)
        factor_af = rope.get("attention_factor")
        if factor_af is None:
            if mscale and mscale_all:
                factor_af = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                factor_af = _yarn_mscale(factor)
        default = 1.0 if deepseek else _yarn_mscale(factor)
        out["yarn_attn_factor"] = 0.0 if factor_af == default else float(factor_af)
    if deepseek:  # MLA's softmax scale: transformers' `yarn_apply_mscale`
        out["yarn_mscale"] = float(mscale_all or 0.0)
    return out


# --------------------------------------------------------------------------- configs


def refuse_unrepresentable(hf: Any) -> None:
    """ValueError naming the first key of a causal-LM config that every family here lacks."""
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act = {act!r}: this model's feed-forward is SwiGLU ('silu')")
    for key in ("attention_bias", "mlp_bias"):
        if getattr(hf, key, False):
            raise ValueError(f"{key} = true: this model's linears have no bias")
    dropout = getattr(hf, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(
            f"attention_dropout = {dropout}: this model's dropout (model.dropout) also drops "
            "the residual branches; import with attention_dropout = 0 and set model.dropout"
        )
    quant = getattr(hf, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(
            f"quantization_config ({method}): quantized weights are not read; dequantize first"
        )


def common_from_hf(hf: Any) -> dict[str, Any]:
    """The model-section values every family reads the same way."""
    return {
        "vocab_size": hf.vocab_size,
        "dim": hf.hidden_size,
        "n_layers": hf.num_hidden_layers,
        "ffn_dim": hf.intermediate_size,
        "norm_eps": hf.rms_norm_eps,
        "max_seq_len": hf.max_position_embeddings,
        "tie_embeddings": bool(hf.tie_word_embeddings),
        "init_std": hf.initializer_range,
    }


def with_rope(config_class: type, kwargs: dict[str, Any], rope: dict[str, Any]) -> Any:
    """`config_class(**kwargs)` with the RoPE in transformers 5's `rope_parameters` or 4's
    `rope_theta` + `rope_scaling`."""
    params = inspect.signature(config_class.__init__).parameters
    if "rope_parameters" in params or "kwargs" in params:
        kwargs["rope_parameters"] = rope  # transformers >= 5
    else:  # pragma: no cover - transformers 4
        rope = dict(rope)
        kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    return config_class(**kwargs)


def hf_config(cfg: ModelConfig) -> Any:
    """A `transformers.LlamaConfig` describing the same architecture (`Qwen3Config` with
    model.qk_norm)."""
    from transformers import LlamaConfig, Qwen3Config

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
    return with_rope(config_class, kwargs, rope_to_hf(cfg))


def config_from_hf(hf: Any, names: Any = None) -> dict[str, Any]:
    """Model-section values (family llama) from a `LlamaConfig`- or `Qwen3Config`-like object.
    Raises ValueError, naming the field, for what this model cannot represent. (`names`, the
    checkpoint's tensor names, matter to the DeepSeek family only.)"""
    refuse_unrepresentable(hf)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and head_dim * heads != hf.hidden_size:
        raise ValueError(
            f"head_dim {head_dim} is not hidden_size / num_attention_heads "
            f"({hf.hidden_size} / {heads}); this model derives head_dim from them"
        )
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("use_sliding_window = true: this model attends over the whole context")
    sliding = [t for t in getattr(hf, "layer_types", None) or [] if t != "full_attention"]
    if sliding:
        raise ValueError(
            f"layer_types holds {sliding[0]!r}: this model attends over the whole context "
            "in every layer"
        )
    return {
        "family": "llama",
        "qk_norm": getattr(hf, "model_type", "llama") == "qwen3",
        **common_from_hf(hf),
        **rope_from_hf(hf, deepseek=False),
        "n_heads": heads,
        "n_kv_heads": getattr(hf, "num_key_value_heads", None) or heads,
    }
