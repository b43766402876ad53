"""Inference from a trained checkpoint: KV-cached sampling (`generate`) and, for models with
multi-token-prediction modules, speculative decoding with them as the draft
(`speculative`)."""

from hyperloom.inference.generate import LoadedModel, complete, generate, load_for_inference
from hyperloom.inference.sampling import (
    GenerationError,
    check_sampling,
    decode_length,
    filter_logits,
    require_sampling,
    sample_next,
)

__all__ = [
    "GenerationError",
    "LoadedModel",
    "check_sampling",
    "complete",
    "decode_length",
    "filter_logits",
    "generate",
    "load_for_inference",
    "require_sampling",
    "sample_next",
]
