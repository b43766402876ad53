"""Inference from a trained checkpoint: KV-cached sampling (`generate`) and, for models with
multi-token-prediction modules, speculative decoding with them as the draft
(`speculative`)."""

from hyperloom.inference.generate import (
    LoadedModel,
    complete,
    decode_length,
    filter_logits,
    generate,
    load_for_inference,
    sample_next,
)

__all__ = [
    "LoadedModel",
    "complete",
    "decode_length",
    "filter_logits",
    "generate",
    "load_for_inference",
    "sample_next",
]
