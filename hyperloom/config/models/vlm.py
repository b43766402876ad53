"""Model fields of the vision-language family (hyperloom.models.vlm) and their checks.

A LLaVA-style model (Liu et al., arXiv 2304.08485 and 2310.03744): a ViT vision encoder in
the CLIP layout (class token, pre-norm, quick-GELU) or the SigLIP one (no class token, a
biased patch embedding, tanh-GELU), a projector from its features to the decoder's width,
and a decoder of the llama or deepseek family, whose keys the rest of `[model]` holds. The
defaults are CLIP ViT-L/14 at 336 px, LLaVA-1.5's encoder; other families leave them alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob, positive

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig
    from hyperloom.config.model import ModelConfig

DECODERS = ("llama", "deepseek")
VISION_ACTS = ("quick_gelu", "gelu", "gelu_tanh")
IMAGE_SOURCES = ("scenes", "llava")  # data.source values that hold images


@dataclass(frozen=True)
class VisionFields:
    """The vision encoder and projector (family 'vlm')."""

    vlm_decoder: str = knob("llama", "the language model's family (family 'vlm')", choices=DECODERS)
    image_size: int = knob(336, "image height = width in pixels the encoder takes")
    patch_size: int = knob(14, "ViT patch size in pixels")
    vision_dim: int = knob(1024, "ViT width")
    vision_layers: int = knob(24, "ViT blocks in the encoder (all are built, as a checkpoint has)")
    vision_heads: int = knob(16, "ViT attention heads")
    vision_ffn_dim: int = knob(4096, "ViT MLP hidden width")
    vision_norm_eps: float = knob(1e-5, "ViT LayerNorm epsilon")
    vision_act: str = knob("quick_gelu", "ViT MLP activation", choices=VISION_ACTS)
    vision_class_token: bool = knob(True, "a learned class token before the patches (CLIP)")
    vision_pre_norm: bool = knob(True, "LayerNorm on the embeddings before the blocks (CLIP)")
    vision_patch_bias: bool = knob(False, "bias in the patch embedding (SigLIP)")
    vision_feature_layer: int = knob(
        -2, "which block's output feeds the projector (negative: from the last, -1 = last)"
    )
    vision_feature_select: str = knob(
        "default", "default = drop the class token, full = keep it", choices=["default", "full"]
    )
    projector: str = knob(
        "mlp", "mlp = linear, GELU, linear (LLaVA-1.5); linear = one linear (LLaVA)",
        choices=["mlp", "linear"],
    )  # fmt: skip
    projector_bias: bool = knob(True, "biases in the projector's linears")
    pixel_shuffle: int = knob(
        1, "merge r x r neighbouring patches into one token before the projector (1 = off)"
    )
    image_token_id: int = knob(32000, "token id of the image placeholder in the text")


def vision_patches(m: ModelConfig) -> int:
    """Patches per image side."""
    return m.image_size // m.patch_size


def vision_feature_depth(m: ModelConfig) -> int:
    """How many encoder blocks run to produce the projector's features."""
    layer = m.vision_feature_layer
    return m.vision_layers + 1 + layer if layer < 0 else layer


def tokens_per_image(m: ModelConfig) -> int:
    """Placeholder tokens one image takes in the text: its patches (and the class token under
    'full'), divided by pixel_shuffle squared."""
    n = vision_patches(m) ** 2 // (m.pixel_shuffle**2)
    return n + (1 if m.vision_class_token and m.vision_feature_select == "full" else 0)


def vlm_problems(job: JobConfig) -> list[str]:
    """The encoder's shape, the feature layer, the placeholder id; parallel layouts the
    family is built for. For another family: these keys left at their defaults."""
    m, par = job.model, job.parallel
    source = job.data.source
    if m.family != "vlm":
        used = [f.name for f in dataclasses.fields(VisionFields) if getattr(m, f.name) != f.default]
        if used:
            return [f"model.{used[0]} needs model.family = 'vlm' (got '{m.family}')"]
        if source in IMAGE_SOURCES:
            return [
                f"data.source = '{source}' holds images: it needs model.family = 'vlm' "
                f"(e.g. --model.preset vlm-tiny); got '{m.family}'"
            ]
        return []
    if source not in IMAGE_SOURCES:
        return [
            f"model.family = 'vlm' trains on image-text data, not data.source = '{source}': set "
            f"data.source = 'scenes' (built in) or 'llava' (LLaVA JSONL; configs/vlm-tiny.toml)"
        ]
    p = [
        *positive("model.image_size", m.image_size),
        *positive("model.patch_size", m.patch_size),
        *positive("model.vision_dim", m.vision_dim),
        *positive("model.vision_layers", m.vision_layers),
        *positive("model.vision_heads", m.vision_heads),
        *positive("model.vision_ffn_dim", m.vision_ffn_dim),
        *positive("model.vision_norm_eps", m.vision_norm_eps),
        *positive("model.pixel_shuffle", m.pixel_shuffle),
    ]
    if p:
        return p
    if m.image_size % m.patch_size:
        p.append(
            f"model.image_size ({m.image_size}) is not divisible by model.patch_size "
            f"({m.patch_size}): {m.image_size} / {m.patch_size} = {m.image_size / m.patch_size:.4g}"
        )
    elif vision_patches(m) % m.pixel_shuffle:
        side = vision_patches(m)
        p.append(
            f"patches per side image_size / patch_size = {side} is not divisible by "
            f"model.pixel_shuffle ({m.pixel_shuffle})"
        )
    if m.vision_dim % m.vision_heads:
        p.append(
            f"model.vision_dim ({m.vision_dim}) is not divisible by model.vision_heads "
            f"({m.vision_heads})"
        )
    if not 1 <= vision_feature_depth(m) <= m.vision_layers:
        p.append(
            f"model.vision_feature_layer = {m.vision_feature_layer} picks none of the "
            f"{m.vision_layers} blocks; use 1..{m.vision_layers} or -1..-{m.vision_layers}"
        )
    if m.pixel_shuffle > 1 and m.vision_class_token and m.vision_feature_select == "full":
        p.append(
            "model.pixel_shuffle merges patches on a grid; the class token has no place there: "
            "use model.vision_feature_select = 'default'"
        )
    if not 0 <= m.image_token_id < m.vocab_size:
        p.append(
            f"model.image_token_id ({m.image_token_id}) must be a token id below "
            f"model.vocab_size ({m.vocab_size})"
        )
    if m.mtp_depth:
        p.append(
            f"model.mtp_depth = {m.mtp_depth} is not built for model.family = 'vlm': MTP embeds "
            f"the labels as its input tokens, and a vlm's labels mask prompts and images"
        )
    if par.cp > 1:
        p.append(
            f"parallel.cp = {par.cp} is not built for model.family = 'vlm' (an image's "
            f"placeholders may straddle two cp ranks' chunks); use tp, pp or dp"
        )
    if par.tp > 1:
        for key, width in (("vision_heads", m.vision_heads), ("vision_ffn_dim", m.vision_ffn_dim)):
            if width % par.tp:
                p.append(f"model.{key} ({width}) is not divisible by parallel.tp ({par.tp})")
    return p


def vlm_tp_widths(m: ModelConfig) -> dict[str, int]:
    """The encoder's and projector's widths tensor parallelism splits, named for messages."""
    return {
        "model.vision_dim (q, k, v rows, out_proj columns)": m.vision_dim,
        "model.vision_ffn_dim (fc1 rows, fc2 columns)": m.vision_ffn_dim,
        "model.dim (projector hidden)": m.dim,
    }
