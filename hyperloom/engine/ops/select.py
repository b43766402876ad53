"""Which implementation each operator uses: the `ops` config section made concrete.

A model holds one `OpImpls`. "fused" is the default (never more memory traffic than the
reference; falls back to eager by itself). "triton" (opt-in) uses the hand-written kernels for
`TRITON_OPS`; where Triton cannot run, `choose` says so once and keeps "fused". The choice is
made in the training process, not in config validation, which may run on another machine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from hyperloom.engine.ops import triton_kernels

log = logging.getLogger("hyperloom.engine.ops")

OPS = ("rmsnorm", "swiglu", "rope", "cross_entropy", "attention")
TRITON_OPS = ("rmsnorm", "swiglu")  # ops with hand-written Triton kernels (triton_kernels.py)


@dataclass(frozen=True)
class OpImpls:
    """Implementation per operator: "reference", "fused", "fused_eager" or "triton" (see
    kernels.py)."""

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
        triton: bool = False,
    ) -> OpImpls:
        """All ops fused (compiled, or eager if `compile` is false), except those named in
        `reference`; or all reference when `fused` is false. `triton` gives `TRITON_OPS` their
        Triton kernels where Triton can run; where it cannot, it warns once and they keep the
        kernels `compile` picks."""
        reference = set(reference)
        unknown = sorted(reference - set(OPS))
        if unknown:
            raise ValueError(f"unknown ops {unknown}; known: {', '.join(OPS)}")
        fast = "fused" if compile else "fused_eager"
        impl = {op: fast if fused and op not in reference else "reference" for op in OPS}
        wants_triton = [op for op in TRITON_OPS if impl[op] != "reference"] if triton else []
        why_not = triton_kernels.unavailable_reason() if wants_triton else None
        if why_not:
            log.warning(
                "ops.triton is on but %s; %s use their %r kernels instead",
                why_not,
                " and ".join(wants_triton),
                fast,
            )
        elif wants_triton:
            impl.update(dict.fromkeys(wants_triton, "triton"))
        return cls(**impl, ce_chunk_tokens=ce_chunk_tokens)


def use_ops(model: nn.Module, impls: OpImpls) -> nn.Module:
    """Give every module of `model` that calls engine ops (it has an `ops` attribute) this
    choice; works for any model family."""
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = impls
    return model
