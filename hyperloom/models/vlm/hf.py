"""Hugging Face `transformers` interop for the vision-language family: `LlavaForConditionalGeneration`.

The config maps to a `LlavaConfig` whose vision tower is a `CLIPVisionConfig` (the CLIP layout:
class token, pre-norm, no patch bias) or a `SiglipVisionConfig` without the attention-pooling
head (the SigLIP layout: none of those, a biased patch embedding), and whose text config is the
decoder family's own (`LlamaConfig` / `Qwen3Config` / `DeepseekV3Config`, through that family's
adapter). LLaVA cannot express a one-linear projector, pixel shuffle, or a tower mixing the two
layouts: export refuses them before writing anything.

Names. The encoder's names are the HF vision tower's under a prefix (`vision.layers.N.*` <->
`vision_tower.vision_model.encoder.layers.N.*`, the embeddings, pre- and post-LayerNorm
renamed), the projector's are `multi_modal_projector.*`, and the decoder's go through its
family's adapter and then under `language_model.` (`model.*` -> `language_model.model.*`,
`lm_head.weight` -> `language_model.lm_head.weight`). Export writes that layout -- the one the
published `llava-hf/*` checkpoints use, which every transformers version and vLLM read; import
also reads transformers 5's own names (`model.language_model.*`, `model.vision_tower.*` without
`vision_model.`, `lm_head.weight`). A SigLIP tower's pooling head, which LLaVA never runs, is
dropped on import with a warning.

Feature selection. HF indexes the tower's `hidden_states` (the embeddings, then each block's
output): `vision_feature_layer` k > 0 is the output of block k, -k the k-th from the last, as
in `model.vision_feature_layer`; 0 (the embeddings) has no counterpart here. HF's "default"
strategy drops position 0 whatever the tower: the class token for CLIP, but the first *patch*
for SigLIP, so a SigLIP tower exports as "full" (our model drops nothing without a class
token) and a SigLIP "default" import is refused.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hyperloom.config import ModelConfig
from hyperloom.config.models.vlm import tokens_per_image

log = logging.getLogger("hyperloom.convert")

# Our encoder name (under `vision.`) -> HF vision tower name (under `vision_model.`), outside
# the blocks. A block's names are the same on both sides, under `layers.N.` / `encoder.layers.N.`.
_VISION_TOP = {
    "patch_embedding.weight": "embeddings.patch_embedding.weight",
    "patch_embedding.bias": "embeddings.patch_embedding.bias",
    "class_embedding": "embeddings.class_embedding",
    "position_embedding.weight": "embeddings.position_embedding.weight",
    "pre_norm.weight": "pre_layrnorm.weight",  # sic: CLIP's spelling
    "pre_norm.bias": "pre_layrnorm.bias",
    "post_norm.weight": "post_layernorm.weight",
    "post_norm.bias": "post_layernorm.bias",
}
_VISION_BLOCK = {
    f"{module}.{leaf}"
    for module in (
        "layer_norm1",
        "layer_norm2",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.out_proj",
        "mlp.fc1",
        "mlp.fc2",
    )
    for leaf in ("weight", "bias")
}
_PROJECTOR = {f"linear_{i}.{leaf}" for i in (1, 2) for leaf in ("weight", "bias")}

# Export prefixes (the published llava-hf layout).
_HF_VISION = "vision_tower.vision_model."
_HF_PROJECTOR = "multi_modal_projector."
_HF_TEXT = "language_model."

# HF activation names <-> ours (gelu_new is the same tanh approximation, computed apart).
_ACT_TO_HF = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
_ACT_FROM_HF = {**{v: k for k, v in _ACT_TO_HF.items()}, "gelu_new": "gelu_tanh"}

_CLIP = "clip_vision_model"
_SIGLIP = "siglip_vision_model"
_TEXT_TYPES = {
    "llama": "llama",
    "qwen3": "llama",
    "deepseek_v3": "deepseek",
    "deepseek_v2": "deepseek",
}


def _decoder_adapter(decoder: str):
    if decoder == "deepseek":
        from hyperloom.models.deepseek import hf

        return hf
    from hyperloom.models.llama import hf

    return hf


def _layout(cfg: ModelConfig) -> str:
    """'clip' or 'siglip' for a tower HF has, else ValueError naming the mix."""
    keys = (cfg.vision_class_token, cfg.vision_pre_norm, cfg.vision_patch_bias)
    if keys == (True, True, False):
        return "clip"
    if keys == (False, False, True):
        return "siglip"
    raise ValueError(
        "the vision tower mixes the CLIP and SigLIP layouts (vision_class_token = "
        f"{cfg.vision_class_token}, vision_pre_norm = {cfg.vision_pre_norm}, vision_patch_bias = "
        f"{cfg.vision_patch_bias}); Hugging Face has CLIP (true, true, false) and SigLIP "
        "(false, false, true) towers only"
    )


def inexpressible(cfg: ModelConfig) -> list[str]:
    """Why `LlavaForConditionalGeneration` cannot hold this model (empty: it can)."""
    problems = []
    if cfg.family != "vlm":
        problems.append(f"model.family = '{cfg.family}' is not a vision-language model")
    if cfg.pixel_shuffle != 1:
        problems.append(
            f"model.pixel_shuffle = {cfg.pixel_shuffle}: Hugging Face LLaVA feeds the projector "
            "every patch (no pixel shuffle); only pixel_shuffle = 1 exports"
        )
    if cfg.projector != "mlp":
        problems.append(
            f"model.projector = '{cfg.projector}': Hugging Face LLaVA's projector is linear, "
            "GELU, linear; only projector = 'mlp' exports"
        )
    try:
        _layout(cfg)
    except ValueError as exc:
        problems.append(str(exc))
    return problems


def _check_expressible(cfg: ModelConfig) -> None:
    problems = inexpressible(cfg)
    if problems:
        raise ValueError(
            "cannot export as transformers' LlavaForConditionalGeneration: " + "; ".join(problems)
        )


# --------------------------------------------------------------------------- state dicts


def _vision_to_hf(name: str) -> str:
    if name in _VISION_TOP:
        return _VISION_TOP[name]
    parts = name.split(".", 2)
    if (
        len(parts) == 3
        and parts[0] == "layers"
        and parts[1].isdigit()
        and parts[2] in _VISION_BLOCK
    ):
        return f"encoder.{name}"
    raise KeyError(f"no Hugging Face name for parameter 'vision.{name}'")


def _vision_from_hf(name: str, full: str) -> str:
    top = {v: k for k, v in _VISION_TOP.items()}
    if name in top:
        return top[name]
    parts = name.split(".", 3)
    if (
        len(parts) == 4
        and parts[:2] == ["encoder", "layers"]
        and parts[2].isdigit()
        and parts[3] in _VISION_BLOCK
    ):
        return name.removeprefix("encoder.")
    raise KeyError(f"no hyperloom name for Hugging Face parameter '{full}'")


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """hyperloom vlm state dict -> `LlavaForConditionalGeneration` checkpoint names (the
    published llava-hf layout). Raises ConvertError for a model LLaVA cannot express."""
    _check_expressible(cfg)
    out: dict[str, torch.Tensor] = {}
    decoder: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.startswith("vision."):
            out[_HF_VISION + _vision_to_hf(name.removeprefix("vision."))] = t
        elif name.startswith("projector."):
            rest = name.removeprefix("projector.")
            if rest not in _PROJECTOR:
                raise KeyError(f"no Hugging Face name for parameter '{name}'")
            out[_HF_PROJECTOR + rest] = t
        else:
            decoder[name] = t
    adapter = _decoder_adapter(cfg.vlm_decoder)
    if cfg.vlm_decoder == "deepseek":
        text = adapter.to_hf_state_dict(decoder, cfg)
    else:
        text = adapter.to_hf_state_dict(decoder)
    for name, t in text.items():  # model.* / lm_head.weight -> under language_model.
        out[_HF_TEXT + name] = t
    return out


def _split_hf(name: str) -> tuple[str, str] | None:
    """An HF LLaVA parameter name -> (part, name within the part); part is 'text' (names as
    the decoder's causal-LM class has them), 'vision' (under the tower's `vision_model`) or
    'projector'. None for a buffer that is not a weight."""
    if name.endswith(("embeddings.position_ids", "rotary_emb.inv_freq")):
        return None
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "text", "lm_head.weight"
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):
        if name.startswith(prefix):
            return "text", "model." + name.removeprefix(prefix)
    for prefix in ("model.vision_tower.", "vision_tower."):
        if name.startswith(prefix):
            return "vision", name.removeprefix(prefix).removeprefix("vision_model.")
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        if name.startswith(prefix):
            return "projector", name.removeprefix(prefix)
    raise KeyError(f"no hyperloom name for Hugging Face parameter '{name}'")


def from_hf_state_dict(
    state: dict[str, torch.Tensor], cfg: ModelConfig, hf: Any = None
) -> dict[str, torch.Tensor]:
    """`LlavaForConditionalGeneration` weights (the llava-hf layout or transformers 5's own
    names) -> hyperloom names. Drops position-id and rotary buffers, a tied lm_head, and a
    SigLIP tower's pooling head (logged: LLaVA never runs it). `hf`, the LLaVA config, tells a
    DeepSeek decoder's RoPE layout (default: interleaved, as released)."""
    out: dict[str, torch.Tensor] = {}
    text: dict[str, torch.Tensor] = {}
    head: list[str] = []
    for name, t in state.items():
        split = _split_hf(name)
        if split is None:
            continue
        part, rest = split
        if part == "text":
            text[rest] = t
        elif part == "projector":
            if rest not in _PROJECTOR:
                raise KeyError(f"no hyperloom name for Hugging Face parameter '{name}'")
            out[f"projector.{rest}"] = t
        elif rest.startswith("head."):
            head.append(name)
        else:
            out[f"vision.{_vision_from_hf(rest, name)}"] = t
    if head:
        log.warning(
            "dropped the SigLIP tower's attention-pooling head (%d tensors, e.g. %s): LLaVA "
            "feeds the projector a block's hidden states and never runs it",
            len(head),
            head[0],
        )
    adapter = _decoder_adapter(cfg.vlm_decoder)
    if cfg.vlm_decoder == "deepseek":
        interleaved = hf is None or adapter.rope_interleaved(hf.text_config)
        out.update(adapter.from_hf_state_dict(text, cfg, interleaved))
    else:
        out.update(adapter.from_hf_state_dict(text, cfg))
    return out


# --------------------------------------------------------------------------- configs


def hf_config(cfg: ModelConfig) -> Any:
    """A `transformers.LlavaConfig` describing the same model. Raises ConvertError for what
    LLaVA cannot express (pixel shuffle, a one-linear projector, a mixed tower layout)."""
    from transformers import CLIPVisionConfig, LlavaConfig, SiglipVisionConfig

    _check_expressible(cfg)
    layout = _layout(cfg)
    vision: dict[str, Any] = dict(
        hidden_size=cfg.vision_dim,
        intermediate_size=cfg.vision_ffn_dim,
        num_hidden_layers=cfg.vision_layers,
        num_attention_heads=cfg.vision_heads,
        num_channels=3,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        layer_norm_eps=cfg.vision_norm_eps,
        hidden_act=_ACT_TO_HF[cfg.vision_act],
        attention_dropout=0.0,
    )
    if layout == "clip":
        vision_config = CLIPVisionConfig(**vision)
        strategy = cfg.vision_feature_select
    else:
        vision_config = SiglipVisionConfig(**vision, vision_use_head=False)
        strategy = "full"  # HF's "default" would drop the first patch: SigLIP has no class token
    text_config = _decoder_adapter(cfg.vlm_decoder).hf_config(cfg)
    return LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=cfg.image_token_id,
        image_seq_length=tokens_per_image(cfg),
        projector_hidden_act="gelu",
        vision_feature_select_strategy=strategy,
        vision_feature_layer=cfg.vision_feature_layer,
        multimodal_projector_bias=cfg.projector_bias,
        tie_word_embeddings=cfg.tie_embeddings,
        architectures=["LlavaForConditionalGeneration"],
    )


def _feature_layer(layer: Any, depth: int) -> int:
    """HF's `vision_feature_layer` (an index into the embeddings and `depth` block outputs)
    -> ours (a block: 1..depth or -1..-depth)."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(
            f"vision_feature_layer = {layer!r}: this model feeds the projector one block's "
            "output (an integer), not several layers' concatenated"
        )
    if layer == 0 or layer == -(depth + 1):
        raise ValueError(
            f"vision_feature_layer = {layer} selects the embeddings before the first block; "
            f"this model feeds the projector a block's output (1..{depth} or -1..-{depth})"
        )
    if not -depth <= layer <= depth:
        raise ValueError(
            f"vision_feature_layer = {layer} is out of range for a {depth}-block vision tower"
        )
    return layer


def config_from_hf(hf: Any, names: list[str] | None = None) -> dict[str, Any]:
    """Model-section values (family vlm) from a `LlavaConfig`-like object (`names`: the
    checkpoint's tensor names, which the decoder's adapter may read). Raises ValueError,
    naming the field, for what this model cannot represent."""
    text, vision = hf.text_config, hf.vision_config
    text_type = getattr(text, "model_type", None)
    if text_type not in _TEXT_TYPES:
        raise ValueError(
            f"text_config.model_type {text_type!r} is not supported; the decoder converts from "
            f"{', '.join(sorted(_TEXT_TYPES))}"
        )
    vision_type = getattr(vision, "model_type", None)
    if vision_type not in (_CLIP, _SIGLIP):
        raise ValueError(
            f"vision_config.model_type {vision_type!r} is not supported; the vision tower "
            f"converts from {_CLIP} or {_SIGLIP}"
        )
    if getattr(vision, "num_channels", 3) != 3:
        raise ValueError(f"vision_config.num_channels = {vision.num_channels}; this model takes 3")
    act = vision.hidden_act
    if act not in _ACT_FROM_HF:
        raise ValueError(
            f"vision_config.hidden_act {act!r} is not supported; use one of "
            f"{', '.join(sorted(_ACT_FROM_HF))}"
        )
    if hf.projector_hidden_act != "gelu":
        raise ValueError(
            f"projector_hidden_act {hf.projector_hidden_act!r}: this model's projector uses "
            "'gelu' (erf)"
        )
    strategy = hf.vision_feature_select_strategy
    clip = vision_type == _CLIP
    if not clip and strategy == "default":
        raise ValueError(
            "vision_feature_select_strategy = 'default' with a SigLIP tower drops the first "
            "patch (SigLIP has no class token to drop); this model keeps every patch ('full')"
        )
    decoder = _TEXT_TYPES[text_type]
    text_names = None
    if names is not None:  # the decoder's, under the names its causal-LM class has
        text_names = [split[1] for n in names if (split := _split_hf(n)) and split[0] == "text"]
    values = _decoder_adapter(decoder).config_from_hf(text, text_names)
    tied = bool(getattr(hf, "tie_word_embeddings", False) or text.tie_word_embeddings)
    values.update(
        family="vlm",
        vlm_decoder=decoder,
        tie_embeddings=tied,
        image_size=vision.image_size,
        patch_size=vision.patch_size,
        vision_dim=vision.hidden_size,
        vision_layers=vision.num_hidden_layers,
        vision_heads=vision.num_attention_heads,
        vision_ffn_dim=vision.intermediate_size,
        vision_norm_eps=vision.layer_norm_eps,
        vision_act=_ACT_FROM_HF[act],
        vision_class_token=clip,
        vision_pre_norm=clip,
        vision_patch_bias=not clip,
        vision_feature_layer=_feature_layer(hf.vision_feature_layer, vision.num_hidden_layers),
        vision_feature_select=strategy,
        projector="mlp",
        projector_bias=bool(hf.multimodal_projector_bias),
        pixel_shuffle=1,
        image_token_id=hf.image_token_id,
    )
    return values
