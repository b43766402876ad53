"""Which implementation each operator uses: the `ops` config section made concrete.

A model holds one `OpImpls` and passes its fields to the `hyperloom.engine.ops` functions.
"fused" is the default wherever it is available: the fused operators never do more memory
traffic than the reference, and when torch.compile is missing or fails their kernels fall
back to eager PyTorch ("fused_eager") by themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

OPS = ("rmsnorm", "swiglu", "rope", "cross_entropy", "attention")


@dataclass(frozen=True)
class OpImpls:
    """Implementation per operator: "reference", "fused" or "fused_eager" (see kernels.py)."""

    rmsnorm: str = "fused"
    swiglu: str = "fused"
    rope: str = "fused"
    cross_entropy: str = "fused"
    attention: str = "fused"
    ce_chunk_tokens: int = 0  # 0 = automatic (engine.ops.cross_entropy.auto_chunk_tokens)

    @classmethod
    def choose(
        cls,
        fused: bool = True,
        compile: bool = True,
        reference: Iterable[str] = (),
        ce_chunk_tokens: int = 0,
    ) -> OpImpls:
        """All ops fused (compiled, or eager if `compile` is false), except those named in
        `reference`; or all reference when `fused` is false."""
        reference = set(reference)
        unknown = sorted(reference - set(OPS))
        if unknown:
            raise ValueError(f"unknown ops {unknown}; known: {', '.join(OPS)}")
        fast = "fused" if compile else "fused_eager"
        impl = {op: fast if fused and op not in reference else "reference" for op in OPS}
        return cls(**impl, ce_chunk_tokens=ce_chunk_tokens)


def use_ops(model: nn.Module, impls: OpImpls) -> nn.Module:
    """Give every module of `model` that calls engine ops (it has an `ops` attribute) this
    choice; works for any model family."""
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = impls
    return model
