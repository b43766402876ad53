"""Operators for the memory-bound parts of a transformer, each as a plain reference and a fused
path (custom autograd that saves little, kernels built by torch.compile).

`impl` selects per call: "reference", "fused", "fused_eager" or "triton"; `OpImpls` holds a
model's choice, made from the `ops` config section.
"""

from hyperloom.engine.ops.attention import attention, attention_reference, sdpa_backends
from hyperloom.engine.ops.cross_entropy import (
    auto_chunk_tokens,
    cross_entropy_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from hyperloom.engine.ops.rmsnorm import rms_norm, rms_norm_reference
from hyperloom.engine.ops.rope import (
    apply_rope,
    rope,
    rope_inv_freq,
    rope_tables,
    scaled_inv_freq,
)
from hyperloom.engine.ops.select import OPS, OpImpls, use_ops
from hyperloom.engine.ops.swiglu import swiglu, swiglu_reference

__all__ = [
    "OPS",
    "OpImpls",
    "apply_rope",
    "attention",
    "attention_reference",
    "auto_chunk_tokens",
    "cross_entropy_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_inv_freq",
    "rope_tables",
    "scaled_inv_freq",
    "sdpa_backends",
    "swiglu",
    "swiglu_reference",
    "use_ops",
]
