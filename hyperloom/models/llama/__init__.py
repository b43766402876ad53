"""The Llama-3 family."""

from hyperloom.models.llama.accounting import matmul_params, param_count, training_flops_per_token
from hyperloom.models.llama.model import KVCache, Llama

__all__ = ["KVCache", "Llama", "matmul_params", "param_count", "training_flops_per_token"]
