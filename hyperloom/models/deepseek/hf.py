"""Hugging Face `transformers` interop for the DeepSeek family: config and state-dict names.

Beyond renaming: DeepSeek checkpoints rotate interleaved RoPE pairs where hyperloom rotates
half-split ones, so import permutes the rope rows of the query projection and of
`kv_a_proj_with_mqa` (evens then odds) and export undoes it; experts import from either the
per-expert safetensors names or transformers 5's stacked `gate_up_proj`/`down_proj`, and
export writes the latter; MTP module k is stored as `model.layers.{n_layers + k}` with copies
of the shared embedding and head, written on export and dropped on import. `transformers` is
optional and imported only inside `hf_config`.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from hyperloom.config import ModelConfig

_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    # MTP modules only
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GATE_UP = "mlp.experts.gate_up_proj"
_OURS = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _rope_perm(r: int) -> torch.Tensor:
    """Half-split position j <- interleaved channel perm[j]: evens, then odds."""
    return torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])


def _permute_rope(name: str, t: torch.Tensor, cfg: ModelConfig, inverse: bool) -> torch.Tensor:
    """Reorder the rope rows of a query or kv_a projection (interleaved <-> half-split)."""
    r = cfg.qk_rope_head_dim
    perm = _rope_perm(r)
    if inverse:
        perm = torch.argsort(perm)
    if name.endswith(("attention.wq.weight", "attention.wq_b.weight")):
        heads = t.unflatten(0, (cfg.n_heads, -1))  # (heads, nope + rope, in)
        nope = heads.shape[1] - r
        return torch.cat([heads[:, :nope], heads[:, nope:][:, perm]], 1).flatten(0, 1)
    if name.endswith("attention.wkv_a.weight"):
        lat = t.shape[0] - r
        return torch.cat([t[:lat], t[lat:][perm]])
    return t


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """hyperloom state dict -> transformers-5 `DeepseekV3ForCausalLM` names and layout (plus
    the MTP layers, in the released checkpoint's naming)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = _permute_rope(name, t, cfg, inverse=True)
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        m = _OURS.match(name)
        if not m:
            raise KeyError(f"no Hugging Face name for parameter '{name}'")
        kind, idx, rest = m.groups()
        layer = int(idx) + (cfg.n_layers if kind == "mtp" else 0)
        prefix = f"model.layers.{layer}."
        if rest == "feed_forward.experts.w1":
            w3 = state[name.removesuffix("w1") + "w3"]
            out[prefix + _GATE_UP] = torch.cat([t, w3], dim=1)  # (E, 2 I, D)
        elif rest == "feed_forward.experts.w3":
            continue
        elif rest in _LAYER and (kind == "mtp" or rest != "norm.weight"):
            out[prefix + _LAYER[rest]] = t
        else:
            raise KeyError(f"no Hugging Face name for parameter '{name}'")
    for k in range(cfg.mtp_depth):  # the released MTP layers carry the shared weights too
        prefix = f"model.layers.{cfg.n_layers + k}."
        out[prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
        head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        out[prefix + "shared_head.head.weight"] = out[head]
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names (transformers-5 fused experts or per-expert safetensors) ->
    hyperloom names; drops rotary buffers, a tied lm_head and the MTP copies."""
    top = {v: k for k, v in _TOP.items()}
    layer_names = {v: k for k, v in _LAYER.items()}
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if name.endswith("rotary_emb.inv_freq") or (
            cfg.tie_embeddings and name == "lm_head.weight"
        ):
            continue
        if name in top:
            out[top[name]] = t
            continue
        m = _HF.match(name)
        if not m:
            raise KeyError(f"no hyperloom name for Hugging Face parameter '{name}'")
        layer, rest = int(m.group(1)), m.group(2)
        mtp = layer >= cfg.n_layers
        ours = f"mtp.{layer - cfg.n_layers}." if mtp else f"layers.{layer}."
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            continue  # copies of the shared embedding and head
        e = _HF_EXPERT.match(rest)
        if rest == _GATE_UP:
            w1, w3 = t.chunk(2, dim=1)  # (E, I, D) each
            out[ours + "feed_forward.experts.w1"] = w1
            out[ours + "feed_forward.experts.w3"] = w3
        elif e:
            which = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[e.group(2)]
            per_expert.setdefault(ours + f"feed_forward.experts.{which}", {})[int(e.group(1))] = t
        elif rest in layer_names and (mtp or layer_names[rest] != "norm.weight"):
            out[ours + layer_names[rest]] = t
        else:
            raise KeyError(f"no hyperloom name for Hugging Face parameter '{name}'")
    for name, experts in per_expert.items():
        out[name] = torch.stack([experts[i] for i in range(len(experts))])  # (E, out, in)
    return {k: _permute_rope(k, v, cfg, inverse=False) for k, v in out.items()}


def hf_config(cfg: ModelConfig) -> Any:
    """A `transformers.DeepseekV3Config` describing the same architecture (sigmoid routing:
    transformers' DeepSeek-V3 model implements V3's `noaux_tc` gate only)."""
    from transformers import DeepseekV3Config

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling > 1:
        rope.update(
            rope_type="yarn",
            factor=cfg.rope_scaling,
            original_max_position_embeddings=cfg.rope_original_max_seq,
            beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow,
            mscale=cfg.yarn_mscale,
            mscale_all_dim=cfg.yarn_mscale,
        )
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        moe_intermediate_size=cfg.moe_ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_routed_experts,
        routed_scaling_factor=cfg.moe_route_scale,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.moe_n_groups,
        topk_group=cfg.moe_topk_groups,
        num_experts_per_tok=cfg.moe_top_k,
        first_k_dense_replace=cfg.n_dense_layers,
        norm_topk_prob=cfg.moe_norm_topk,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        rope_interleave=True,
        num_nextn_predict_layers=cfg.mtp_depth,
        hidden_act="silu",
    )
    params = inspect.signature(DeepseekV3Config.__init__).parameters
    if "rope_parameters" in params or "kwargs" in params:
        kwargs["rope_parameters"] = rope  # transformers >= 5
    else:  # pragma: no cover - transformers 4
        kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    return DeepseekV3Config(**kwargs)


def config_from_hf(hf: Any) -> dict[str, Any]:
    """Model-section values (family deepseek) from a `DeepseekV3Config`-like object."""
    from hyperloom.models.llama.hf import hf_rope_and_common

    rope, common = hf_rope_and_common(hf, "yarn", 4096)
    return {
        "family": "deepseek",
        **common,
        "n_heads": hf.num_attention_heads,
        "n_kv_heads": hf.num_attention_heads,
        "n_routed_experts": hf.n_routed_experts or 0,
        "n_shared_experts": hf.n_shared_experts or 0,
        "moe_top_k": hf.num_experts_per_tok or 0,
        "moe_ffn_dim": hf.moe_intermediate_size,
        "n_dense_layers": hf.first_k_dense_replace or 0,
        "moe_score": getattr(hf, "scoring_func", "sigmoid"),
        "moe_n_groups": hf.n_group or 1,
        "moe_topk_groups": hf.topk_group or 1,
        "moe_norm_topk": bool(hf.norm_topk_prob),
        "moe_route_scale": float(hf.routed_scaling_factor),
        "q_lora_rank": hf.q_lora_rank or 0,
        "kv_lora_rank": hf.kv_lora_rank,
        "qk_nope_head_dim": hf.qk_nope_head_dim,
        "qk_rope_head_dim": hf.qk_rope_head_dim,
        "v_head_dim": hf.v_head_dim,
        "yarn_beta_fast": float(rope.get("beta_fast", 32.0)),
        "yarn_beta_slow": float(rope.get("beta_slow", 1.0)),
        "yarn_mscale": float(rope.get("mscale_all_dim", 1.0) or 1.0),
        "mtp_depth": getattr(hf, "num_nextn_predict_layers", 0) or 0,
    }
