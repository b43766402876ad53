"""Closed-form parameter and FLOP counts for the vision-language family.

The encoder and projector are counted exactly as built (every block, the final LayerNorm
too: a checkpoint holds them), the decoder by its own family's accounting. Training FLOPs
follow the decoder's convention (6 per matmul weight per token plus the attention products,
arXiv 2204.02311 appendix B): the encoder adds 6 · (its matmul weights) per patch token of
the blocks that run, plus 12 · depth · tokens · vision_dim for its (bidirectional) attention,
for one image per sequence -- LLaVA's common case -- spread over the sequence's tokens.
"""

from __future__ import annotations

from hyperloom.config import ModelConfig
from hyperloom.config.models.vlm import tokens_per_image, vision_feature_depth, vision_patches


def _decoder(cfg: ModelConfig):
    if cfg.vlm_decoder == "deepseek":
        from hyperloom.models import deepseek

        return deepseek
    from hyperloom.models import llama

    return llama


def vision_block_params(cfg: ModelConfig) -> int:
    d, f = cfg.vision_dim, cfg.vision_ffn_dim
    return 4 * (d * d + d) + 2 * (d * f) + f + d + 4 * d  # attention, MLP, two LayerNorms


def vision_positions(cfg: ModelConfig) -> int:
    """Token positions the encoder runs on per image (patches, and the class token)."""
    return vision_patches(cfg) ** 2 + (1 if cfg.vision_class_token else 0)


def vision_param_count(cfg: ModelConfig) -> int:
    """The encoder's parameters, all blocks and the final LayerNorm included."""
    d, p = cfg.vision_dim, cfg.patch_size
    embed = 3 * p * p * d + (d if cfg.vision_patch_bias else 0)
    embed += (d if cfg.vision_class_token else 0) + vision_positions(cfg) * d
    norms = (2 * d if cfg.vision_pre_norm else 0) + 2 * d
    return embed + norms + cfg.vision_layers * vision_block_params(cfg)


def projector_param_count(cfg: ModelConfig) -> int:
    width_in = cfg.vision_dim * cfg.pixel_shuffle**2
    bias = 1 if cfg.projector_bias else 0
    first = width_in * cfg.dim + bias * cfg.dim
    return first + ((cfg.dim * cfg.dim + bias * cfg.dim) if cfg.projector == "mlp" else 0)


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters: encoder, projector and decoder."""
    return vision_param_count(cfg) + projector_param_count(cfg) + _decoder(cfg).param_count(cfg)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one text token uses (a MoE decoder's active ones) plus the vision side."""
    dec = _decoder(cfg)
    active = getattr(dec, "active_param_count", dec.param_count)
    return vision_param_count(cfg) + projector_param_count(cfg) + active(cfg)


def vision_training_flops_per_image(cfg: ModelConfig) -> int:
    """Forward + backward FLOPs of the encoder and projector for one image."""
    d, f, depth = cfg.vision_dim, cfg.vision_ffn_dim, vision_feature_depth(cfg)
    n = vision_positions(cfg)
    blocks = depth * (6 * (4 * d * d + 2 * d * f) * n + 12 * n * n * d)
    patch = 6 * 3 * cfg.patch_size**2 * d * vision_patches(cfg) ** 2
    proj_w = cfg.vision_dim * cfg.pixel_shuffle**2 * cfg.dim
    proj_w += cfg.dim * cfg.dim if cfg.projector == "mlp" else 0
    return blocks + patch + 6 * proj_w * tokens_per_image(cfg)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Decoder FLOPs per token plus one image's encoder FLOPs spread over `seq_len` tokens."""
    per_image = vision_training_flops_per_image(cfg)
    return _decoder(cfg).training_flops_per_token(cfg, seq_len) + per_image // seq_len
