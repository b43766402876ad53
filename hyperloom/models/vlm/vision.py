"""The ViT vision encoder of a vision-language model, single-device code.

Images are cut into patch_size x patch_size patches, each embedded by one strided
convolution, with a learned position embedding per patch (and a learned class token in front
in the CLIP layout); pre-norm blocks x + Attn(LN(x)), x + MLP(LN(x)) follow (Dosovitskiy et
al., arXiv 2010.11929; CLIP, arXiv 2103.00020; SigLIP, arXiv 2303.15343). Attention is
bidirectional over the patches of one image. LLaVA feeds the projector the output of an inner
block (`model.vision_feature_layer`, -2 = the second to last), so only that many blocks run;
the blocks above it and the final LayerNorm exist, as a checkpoint has them, but take no part
(`unused_parameters`: the trainer freezes them). Block names follow Hugging Face's
CLIP/SigLIP vision towers; `hf.py` renames the embeddings and the two outer LayerNorms.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyperloom.config import ModelConfig
from hyperloom.config.models.vlm import vision_feature_depth, vision_patches
from hyperloom.engine import ops
from hyperloom.engine.ops import OpImpls


def vision_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """quick_gelu x·σ(1.702x) (CLIP), gelu (erf) or gelu_tanh (SigLIP)."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


class VisionCoreAttention(nn.Module):
    """softmax(q kᵀ / √d) v over (images, heads, patches, head_dim), not causal: a module of
    its own so that recompute can drop it ("core_attn")."""

    def __init__(self):
        super().__init__()
        self.ops = OpImpls()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ops.attention(q, k, v, is_causal=False, impl=self.ops.attention)


class VisionAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Head counts are read from the projections' shapes: under tensor parallelism each
        # rank holds a slice of the heads.
        self.head_dim = cfg.vision_dim // cfg.vision_heads
        self.q_proj = nn.Linear(cfg.vision_dim, cfg.vision_dim)
        self.k_proj = nn.Linear(cfg.vision_dim, cfg.vision_dim)
        self.v_proj = nn.Linear(cfg.vision_dim, cfg.vision_dim)
        self.out_proj = nn.Linear(cfg.vision_dim, cfg.vision_dim)
        self.core_attention = VisionCoreAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (n, p, dim) -> (n, heads, p, head_dim)
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        out = self.core_attention(q, k, v).transpose(1, 2).flatten(2)  # (n, p, heads * d)
        return self.out_proj(out)


class VisionAct(nn.Module):
    """The MLP's activation as a module, so that recompute can drop its output ("mlp_act")."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vision_activation(self.name, x)


class VisionMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.vision_dim, cfg.vision_ffn_dim)
        self.act = VisionAct(cfg.vision_act)
        self.fc2 = nn.Linear(cfg.vision_ffn_dim, cfg.vision_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.vision_dim, eps=cfg.vision_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.vision_dim, eps=cfg.vision_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """Images (n, 3, H, W) -> features (n, tokens, vision_dim) of the feature layer, the
    class token dropped unless `vision_feature_select` is 'full'."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.vision_dim
        self.patch_embedding = nn.Conv2d(
            3, d, cfg.patch_size, stride=cfg.patch_size, bias=cfg.vision_patch_bias
        )
        self.class_embedding = nn.Parameter(torch.empty(d)) if cfg.vision_class_token else None
        positions = vision_patches(cfg) ** 2 + (1 if cfg.vision_class_token else 0)
        self.position_embedding = nn.Embedding(positions, d)
        self.pre_norm = nn.LayerNorm(d, eps=cfg.vision_norm_eps) if cfg.vision_pre_norm else None
        self.layers = nn.ModuleDict({str(i): VisionBlock(cfg) for i in range(cfg.vision_layers)})
        self.post_norm = nn.LayerNorm(d, eps=cfg.vision_norm_eps)
        self.depth = vision_feature_depth(cfg)

    def unused_parameters(self) -> list[str]:
        """Parameters (names under this module) the features never reach: the blocks above
        the feature layer and the final LayerNorm."""
        return [
            n
            for n, _ in self.named_parameters()
            if n.startswith("post_norm.")
            or (n.startswith("layers.") and int(n.split(".")[1]) >= self.depth)
        ]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if images.shape[-3:] != (3, c.image_size, c.image_size):
            raise ValueError(
                f"images of shape {tuple(images.shape[-3:])} (channels, height, width); the "
                f"encoder takes (3, {c.image_size}, {c.image_size}) (model.image_size)"
            )
        w = self.patch_embedding.weight
        x = self.patch_embedding(images.to(w.dtype))  # (n, dim, side, side)
        x = x.flatten(2).transpose(1, 2)  # (n, side * side, dim), patches row by row
        if self.class_embedding is not None:
            cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)  # (n, 1, dim)
            x = torch.cat([cls, x], dim=1)
        x = x + self.position_embedding.weight.to(x.dtype)  # (n, positions, dim)
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        for i in range(self.depth):
            x = self.layers[str(i)](x)
        if self.class_embedding is not None and c.vision_feature_select == "default":
            x = x[:, 1:]  # (n, side * side, dim): the patches only
        return x


class Projector(nn.Module):
    """Encoder features (n, tokens, vision_dim) -> the decoder's width (n, tokens', dim).

    `pixel_shuffle` r > 1 first merges each r x r block of neighbouring patches into one
    token of r²·vision_dim features (InternVL, arXiv 2404.16821; Idefics3's "pixel shuffle"),
    cutting an image's tokens r²-fold. Then linear, GELU, linear (LLaVA-1.5) or one linear
    (the first LLaVA)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        r = cfg.pixel_shuffle
        self.linear_1 = nn.Linear(cfg.vision_dim * r * r, cfg.dim, bias=cfg.projector_bias)
        self.linear_2 = (
            nn.Linear(cfg.dim, cfg.dim, bias=cfg.projector_bias) if cfg.projector == "mlp" else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.cfg.pixel_shuffle
        if r > 1:
            n, tokens, d = x.shape
            side = math.isqrt(tokens)
            x = x.reshape(n, side // r, r, side // r, r, d)  # (n, rows, r, cols, r, d)
            x = x.permute(0, 1, 3, 2, 4, 5).reshape(n, (side // r) ** 2, r * r * d)
        x = self.linear_1(x)
        if self.linear_2 is None:
            return x
        return self.linear_2(F.gelu(x))
