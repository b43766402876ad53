"""The DeepSeek-V3 family: MoE with auxiliary-loss-free balancing, MLA and multi-token
prediction.

The model classes are imported on first use (`hyperloom.models.lazy`): the accounting runs
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperloom.models.deepseek.accounting import (
    active_param_count,
    main_param_count,
    mtp_param_count,
    param_count,
    training_flops_per_token,
)
from hyperloom.models.lazy import lazy_attributes

if TYPE_CHECKING:
    from hyperloom.models.deepseek.mla import MLACache
    from hyperloom.models.deepseek.model import DeepSeekV3

_LAZY = {
    "DeepSeekV3": "hyperloom.models.deepseek.model",
    "MLACache": "hyperloom.models.deepseek.mla",
}

__all__ = [
    "DeepSeekV3",
    "MLACache",
    "active_param_count",
    "main_param_count",
    "mtp_param_count",
    "param_count",
    "training_flops_per_token",
]


__getattr__ = lazy_attributes(__name__, _LAZY)
