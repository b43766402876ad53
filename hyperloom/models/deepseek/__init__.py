"""The DeepSeek-V3 family: MoE with auxiliary-loss-free balancing, MLA and multi-token
prediction."""

from hyperloom.models.deepseek.accounting import (
    active_param_count,
    main_param_count,
    mtp_param_count,
    param_count,
    training_flops_per_token,
)
from hyperloom.models.deepseek.mla import MLACache
from hyperloom.models.deepseek.model import DeepSeekV3

__all__ = [
    "DeepSeekV3",
    "MLACache",
    "active_param_count",
    "main_param_count",
    "mtp_param_count",
    "param_count",
    "training_flops_per_token",
]
