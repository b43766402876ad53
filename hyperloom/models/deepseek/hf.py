"""Hugging Face `transformers` interop for the DeepSeek family: config and state-dict names.

Routing picks the class: a sigmoid-routed model is `DeepseekV3ForCausalLM` (V3's `noaux_tc`
gate with its correction bias), a softmax-routed one `DeepseekV2ForCausalLM` (`topk_method`
greedy, or group_limited_greedy with expert groups, scored by their best expert). transformers'
V2 gate neither renormalises the top-k weights nor has a selection bias, so a V2 export refuses
`moe_norm_topk` and a non-zero `expert_bias`, and has no MTP modules.

Beyond renaming: DeepSeek checkpoints rotate interleaved RoPE pairs where hyperloom rotates
half-split ones, so import permutes the rope rows of the query projection and of
`kv_a_proj_with_mqa` (evens then odds) and export undoes it (a V3 config with
`rope_interleave = false` is half-split already and imports unpermuted); experts import from
either the per-expert safetensors names or transformers 5's stacked `gate_up_proj`/`down_proj`,
and export writes the latter. MTP module k is `model.layers.{n_layers + k}` as in the released
V3 checkpoint, with its own copies of the shared embedding (`embed_tokens`) and head
(`shared_head.head`): export writes the copies, import checks they equal the shared tensors
(this model shares them) and drops them. transformers' V3 config declares one MTP layer by
default while its model has none, so import counts the MTP layers the weights hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from hyperloom.config import ModelConfig
from hyperloom.models.llama.hf import (
    common_from_hf,
    refuse_unrepresentable,
    rope_from_hf,
    rope_to_hf,
    with_rope,
)

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
_BIAS = "feed_forward.router.expert_bias"
_OURS = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# transformers' V2 gate: softmax scores, then one of these selections
_V2_TOPK = {"greedy": False, "group_limited_greedy": True}  # -> uses expert groups


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


def check_v2(cfg: ModelConfig, state: dict[str, torch.Tensor] | None = None) -> None:
    """ValueError saying why transformers' `DeepseekV2ForCausalLM` cannot hold this
    softmax-routed model (and its weights `state`), if it cannot."""
    problems = []
    if cfg.n_routed_experts and cfg.moe_norm_topk:
        problems.append(
            "model.moe_norm_topk = true: transformers' DeepseekV2 gate does not renormalise "
            "the top-k softmax weights"
        )
    if cfg.mtp_depth:
        problems.append(f"model.mtp_depth = {cfg.mtp_depth}: DeepseekV2 has no MTP modules")
    if state is not None and any(n.endswith(_BIAS) and t.any() for n, t in state.items()):
        problems.append(
            "the routers' expert_bias is not zero (model.moe_bias_rate moved it): "
            "transformers' DeepseekV2 gate has no selection bias"
        )
    if problems:
        raise ValueError(
            "cannot export as transformers' DeepseekV2ForCausalLM: " + "; ".join(problems)
        )


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """hyperloom state dict -> transformers-5 `DeepseekV3ForCausalLM` (sigmoid routing) or
    `DeepseekV2ForCausalLM` (softmax) names and layout, plus the MTP layers in the released
    checkpoint's naming. ValueError for what the class cannot hold."""
    v2 = cfg.moe_score == "softmax"
    if v2:
        check_v2(cfg, state)
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
        elif rest == "feed_forward.experts.w3" or (v2 and rest == _BIAS):
            continue
        elif rest in _LAYER and (kind == "mtp" or rest != "norm.weight"):
            out[prefix + _LAYER[rest]] = t
        else:
            raise KeyError(f"no Hugging Face name for parameter '{name}'")
    for k in range(cfg.mtp_depth):  # the released MTP layers carry copies of the shared ones
        prefix = f"model.layers.{cfg.n_layers + k}."
        head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        # copies, not views: safetensors stores no tensor under two names
        out[prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[prefix + "shared_head.head.weight"] = out[head].clone()
    return out


def _check_shared_copy(name: str, copy: torch.Tensor, shared: torch.Tensor | None) -> None:
    if shared is None or not torch.equal(copy, shared):
        raise ValueError(
            f"'{name}' differs from the model's shared embedding / head; this model's MTP "
            "modules share them"
        )


def from_hf_state_dict(
    state: dict[str, torch.Tensor], cfg: ModelConfig, interleaved: bool = True
) -> dict[str, torch.Tensor]:
    """Hugging Face names (transformers-5 fused experts or per-expert safetensors) ->
    hyperloom names. Drops rotary buffers, a tied lm_head, zero-width shared experts
    (transformers builds them for n_shared_experts = 0) and the MTP layers' copies of the
    shared embedding and head (checked equal); a router without a correction bias (V2) gets a
    zero one. `interleaved`: the rope rows are in DeepSeek's interleaved order."""
    top = {v: k for k, v in _TOP.items()}
    layer_names = {v: k for k, v in _LAYER.items()}
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    copies: dict[str, torch.Tensor] = {}
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
        if mtp and rest in ("embed_tokens.weight", "shared_head.head.weight"):
            copies[name] = t
            continue
        if rest.startswith("mlp.shared_experts.") and t.numel() == 0:
            continue
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
    head = "tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"
    for name, copy in copies.items():
        embedding = name.endswith("embed_tokens.weight")
        _check_shared_copy(name, copy, out.get("tok_embeddings.weight" if embedding else head))
    for name, experts in per_expert.items():
        out[name] = torch.stack([experts[i] for i in range(len(experts))])  # (E, out, in)
    for name in [n for n in out if n.endswith("feed_forward.router.weight")]:
        bias = name.replace("router.weight", "router.expert_bias")
        if bias not in out:  # transformers' V2 gate has none: the selection is unbiased
            out[bias] = torch.zeros(out[name].shape[0], dtype=torch.float32)
    if not interleaved:
        return out
    return {k: _permute_rope(k, v, cfg, inverse=False) for k, v in out.items()}


def hf_config(cfg: ModelConfig) -> Any:
    """A `transformers.DeepseekV3Config` (sigmoid routing) or `DeepseekV2Config` (softmax)
    describing the same architecture."""
    from transformers import DeepseekV2Config, DeepseekV3Config

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
        hidden_act="silu",
    )
    if cfg.moe_score == "softmax":
        check_v2(cfg)
        grouped = cfg.moe_n_groups > 1
        kwargs["topk_method"] = "group_limited_greedy" if grouped else "greedy"
        return with_rope(DeepseekV2Config, kwargs, rope_to_hf(cfg))
    kwargs.update(rope_interleave=True, num_nextn_predict_layers=cfg.mtp_depth)
    return with_rope(DeepseekV3Config, kwargs, rope_to_hf(cfg))


def rope_interleaved(hf: Any) -> bool:
    """Whether the checkpoint's rope rows are interleaved pairs: always for V2 (complex
    rotation), V3 unless `rope_interleave = false`."""
    return getattr(hf, "model_type", "") != "deepseek_v3" or getattr(hf, "rope_interleave", True)


def mtp_layers(names: Iterable[str], n_layers: int, declared: int) -> int:
    """How many of the `declared` MTP layers (model.layers.{n_layers + k}) the weights hold."""
    present = {int(m.group(1)) for n in names if (m := _HF.match(n))}
    depth = 0
    while depth < declared and n_layers + depth in present:
        depth += 1
    return depth


def _routing_from_hf(hf: Any) -> dict[str, Any]:
    """moe_score and group-limited routing: V3's sigmoid noaux_tc, V2's softmax selections.
    The reference code's `scoring_func` / `topk_method`, where present, must agree with the
    class's gate (transformers reads neither)."""
    v3 = getattr(hf, "model_type", "") == "deepseek_v3"
    score = "sigmoid" if v3 else "softmax"
    scoring = getattr(hf, "scoring_func", None)
    if scoring is not None and scoring != score:
        raise ValueError(
            f"scoring_func = {scoring!r}, but transformers' {hf.model_type} gate scores with "
            f"{score}"
        )
    method = getattr(hf, "topk_method", None)
    groups, topk_groups = hf.n_group or 1, hf.topk_group or 1
    if v3:
        if method not in (None, "noaux_tc"):
            raise ValueError(
                f"topk_method = {method!r}, but transformers' deepseek_v3 gate is 'noaux_tc'"
            )
    elif method not in _V2_TOPK:
        raise ValueError(
            f"topk_method = {method!r} is not supported; deepseek_v2 routes with "
            f"{' or '.join(_V2_TOPK)}"
        )
    elif not _V2_TOPK[method]:  # greedy: one group
        groups = topk_groups = 1
    norm = bool(hf.norm_topk_prob)
    if not v3 and norm and hf.n_routed_experts:
        raise ValueError(
            "norm_topk_prob = true: transformers' DeepseekV2 gate ignores it (the reference "
            "code renormalises), so the model is ambiguous"
        )
    freq = getattr(hf, "moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(
            f"moe_layer_freq = {freq}: this model puts MoE in every layer after the dense ones"
        )
    return {
        "moe_score": score,
        "moe_n_groups": groups,
        "moe_topk_groups": topk_groups,
        "moe_norm_topk": norm,
    }


def config_from_hf(hf: Any, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Model-section values (family deepseek) from a `DeepseekV3Config`- or
    `DeepseekV2Config`-like object. `names`: the checkpoint's tensor names, from which the MTP
    depth is counted (without them, the declared `num_nextn_predict_layers`). ValueError,
    naming the key, for what this model cannot represent. `num_key_value_heads` is not read:
    MLA expands one latent into every head (transformers' default of 128 means nothing)."""
    refuse_unrepresentable(hf)
    declared = getattr(hf, "num_nextn_predict_layers", 0) or 0
    depth = declared if names is None else mtp_layers(names, hf.num_hidden_layers, declared)
    return {
        "family": "deepseek",
        **common_from_hf(hf),
        **rope_from_hf(hf, deepseek=True),
        **_routing_from_hf(hf),
        "n_heads": hf.num_attention_heads,
        "n_kv_heads": hf.num_attention_heads,
        "n_routed_experts": hf.n_routed_experts or 0,
        "n_shared_experts": hf.n_shared_experts or 0,
        "moe_top_k": hf.num_experts_per_tok or 0,
        "moe_ffn_dim": hf.moe_intermediate_size,
        "n_dense_layers": hf.first_k_dense_replace or 0,
        "moe_route_scale": float(hf.routed_scaling_factor),
        "q_lora_rank": hf.q_lora_rank or 0,
        "kv_lora_rank": hf.kv_lora_rank,
        "qk_nope_head_dim": hf.qk_nope_head_dim,
        "qk_rope_head_dim": hf.qk_rope_head_dim,
        "v_head_dim": hf.v_head_dim,
        "mtp_depth": depth,
    }
