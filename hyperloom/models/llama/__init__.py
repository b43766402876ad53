"""The Llama-3 family.

The model classes are imported on first use (`hyperloom.models.lazy`): the accounting runs
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperloom.models.lazy import lazy_attributes
from hyperloom.models.llama.accounting import matmul_params, param_count, training_flops_per_token

if TYPE_CHECKING:
    from hyperloom.models.llama.model import KVCache, Llama

_LAZY = {"KVCache": "hyperloom.models.llama.model", "Llama": "hyperloom.models.llama.model"}

__all__ = ["KVCache", "Llama", "matmul_params", "param_count", "training_flops_per_token"]


__getattr__ = lazy_attributes(__name__, _LAZY)
