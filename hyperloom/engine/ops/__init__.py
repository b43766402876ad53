"""Operators for the memory-bound parts of a transformer (reference implementations)."""

from hyperloom.engine.ops.rope import apply_rope, rope_inv_freq, rope_tables

__all__ = ["apply_rope", "rope_inv_freq", "rope_tables"]
