"""The vision-language family: a ViT encoder, a projector and a llama or deepseek decoder
(LLaVA's layout).

The model classes are imported on first use (`hyperloom.models.lazy`): the accounting runs
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperloom.models.lazy import lazy_attributes
from hyperloom.models.vlm.accounting import (
    active_param_count,
    param_count,
    projector_param_count,
    training_flops_per_token,
    vision_param_count,
)

if TYPE_CHECKING:
    from hyperloom.models.vlm.inputs import ImageTokens
    from hyperloom.models.vlm.model import LlavaDeepSeek, LlavaLlama, build_vlm

_LAZY = {
    "ImageTokens": "hyperloom.models.vlm.inputs",
    "LlavaLlama": "hyperloom.models.vlm.model",
    "LlavaDeepSeek": "hyperloom.models.vlm.model",
    "build_vlm": "hyperloom.models.vlm.model",
}

__all__ = [
    "ImageTokens",
    "LlavaDeepSeek",
    "LlavaLlama",
    "active_param_count",
    "build_vlm",
    "param_count",
    "projector_param_count",
    "training_flops_per_token",
    "vision_param_count",
]


__getattr__ = lazy_attributes(__name__, _LAZY)
