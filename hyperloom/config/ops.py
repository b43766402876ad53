"""The `[ops]` section: which fused operators (hyperloom.engine.ops) a run uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig

OPS = ("rmsnorm", "swiglu", "rope", "cross_entropy", "attention")  # engine.ops.select.OPS


@dataclass(frozen=True)
class OpsConfig:
    """Fused operators (hyperloom.engine.ops): RMSNorm, SwiGLU, RoPE, cross-entropy, attention."""

    fused: bool = knob(True, "use the fused operators (false = plain reference PyTorch)")
    compile: bool = knob(
        True, "build the fused kernels with torch.compile (false = same algorithms, eager)"
    )
    reference: list[str] = knob(
        doc="ops kept on the reference path when fused: rmsnorm, swiglu, rope, "
        "cross_entropy, attention",
        factory=list,
    )
    ce_chunk_tokens: int = knob(
        0, "tokens per chunk of the fused cross-entropy (0 = logits chunk ~ hidden size)"
    )
    triton: bool = knob(
        False,
        "hand-written Triton kernels for RMSNorm and SwiGLU (GPU, or the interpreter with "
        "TRITON_INTERPRET=1; without either, a warning and the fused kernels); off: their "
        "speed against the torch.compile kernels is not measured yet",
    )

    def problems(self, job: JobConfig) -> list[str]:
        """Known op names; a chunk size of 0 or more."""
        p = []
        unknown = [n for n in self.reference if n not in OPS]
        if unknown:
            p.append(f"ops.reference: {unknown} are not ops; allowed: {', '.join(OPS)}")
        if self.ce_chunk_tokens < 0:
            p.append(
                f"ops.ce_chunk_tokens must be >= 0 (0 = automatic), got {self.ce_chunk_tokens}"
            )
        return p
