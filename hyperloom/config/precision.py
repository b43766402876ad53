"""The `[precision]` section: compute dtype and FP8 (hyperloom.engine.fp8), and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig

FP8_GEMMS = ("fprop", "dgrad", "wgrad")  # engine.fp8.recipes.GEMMS (no engine import here)

# Elements per scale block of the block recipes: a tensor-parallel shard holds whole blocks.
_SCALE_BLOCK = {"blockwise": 128, "mxfp8": 32}


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric formats."""

    dtype: str = knob(
        "bf16",
        "compute dtype; master weights and optimizer state stay fp32",
        choices=["bf16", "fp32"],
    )
    fp8: str = knob(
        "none",
        "FP8 GEMMs in linear layers: none, or the scaling recipe (see hyperloom.engine.fp8)",
        choices=["none", "delayed", "current", "rowwise", "blockwise", "mxfp8"],
    )
    fp8_delayed_update: str = knob(
        "microbatch",
        "under fp8 = 'delayed': when scales move -- 'microbatch' before every quantization "
        "(TE's update per fp8_autocast region), 'step' once per optimizer step after the "
        "amaxes are reduced, so dp replicas, pp ranks and DualPipe's two chunk copies take "
        "one process's scales (hyperloom.engine.fp8.recipes)",
        choices=["microbatch", "step"],
    )
    fp8_keep: list[str] = knob(
        doc="module path patterns (fnmatch) whose linears stay in high precision under fp8",
        factory=lambda: [
            "tok_embeddings",
            "*embed*",
            "output",
            "lm_head",
            "*router*",
            "*.gate",
            "*norm*",
        ],
    )
    fp8_high_precision: list[str] = knob(
        doc="GEMMs of every FP8 linear run in high precision instead: fprop, dgrad, wgrad "
        "(TE's override_linear_precision; ['wgrad'] is Megatron's --no-fp8-wgrad)",
        factory=list,
    )
    fp8_activation: bool = knob(
        False,
        "under fp8, every FP8 linear (and MoE expert) saves the FP8 copy of its input for "
        "backward, 1 byte per element instead of the high-precision input, as DeepSeek-V3 "
        "caches activations; blockwise, MXFP8 and rowwise re-tile it for the weight "
        "gradient, a second rounding (current and delayed keep only the FP8 copy anyway "
        "whenever their weight-gradient GEMM is FP8)",
    )
    fp8_bf16_first_layers: int = knob(
        0,
        "under fp8, the first N transformer blocks keep every linear in high precision "
        "(Megatron's --first-last-layers-bf16 with --num-layers-at-start-in-bf16)",
    )
    fp8_bf16_last_layers: int = knob(
        0,
        "under fp8, the last N transformer blocks keep every linear in high precision "
        "(Megatron's --num-layers-at-end-in-bf16)",
    )

    def problems(self, job: JobConfig) -> list[str]:
        """The FP8 knobs against the model's depth and, under tp > 1, its shard widths."""
        p = _high_precision_problems(self.fp8_high_precision) + _layer_problems(job)
        if self.fp8_delayed_update != "microbatch" and self.fp8 not in ("delayed", "none"):
            p.append(
                f"precision.fp8_delayed_update = '{self.fp8_delayed_update}' applies to "
                f"precision.fp8 = 'delayed' only (here '{self.fp8}'); set precision.fp8 = "
                f"'delayed' or leave fp8_delayed_update at 'microbatch'"
            )
        par = job.parallel
        if self.fp8 != "none" and par.tp > 1 and not par.invalid_degrees():
            p.extend(_tensor_parallel_problems(job))
        return p


def _high_precision_problems(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in FP8_GEMMS]
    if unknown:
        return [
            f"precision.fp8_high_precision: {unknown} are not GEMMs of a linear layer; "
            f"allowed: {', '.join(FP8_GEMMS)}"
        ]
    if set(names) == set(FP8_GEMMS):
        return [
            "precision.fp8_high_precision names all three GEMMs, which leaves nothing in "
            "FP8; set precision.fp8 = 'none' instead"
        ]
    return []


def _layer_problems(job: JobConfig) -> list[str]:
    p8, n = job.precision, job.model.n_layers
    first, last = p8.fp8_bf16_first_layers, p8.fp8_bf16_last_layers
    if first < 0 or last < 0:
        return [
            f"precision.fp8_bf16_first_layers ({first}) and precision.fp8_bf16_last_layers "
            f"({last}) count transformer blocks: 0 or more"
        ]
    if p8.fp8 != "none" and first + last >= n:
        return [
            f"precision.fp8_bf16_first_layers + fp8_bf16_last_layers = {first + last} keeps "
            f"all {n} blocks in high precision, which leaves nothing in FP8; set "
            f"precision.fp8 = 'none' instead"
        ]
    return []


def _tensor_parallel_problems(job: JobConfig) -> list[str]:
    """FP8 with tp > 1: per-tensor recipes reduce their amax over the group, rowwise its row
    amaxes where the contraction dimension is sharded; block recipes need every
    tensor-parallel shard to be whole scale blocks (hyperloom.parallel.tensor_parallel). The
    model family names the widths that split over tp."""
    m, fp8, tp = job.model, job.precision.fp8, job.parallel.tp
    block = _SCALE_BLOCK.get(fp8)
    if block is None or m.n_heads <= 0:
        return []
    return [
        f"precision.fp8 = '{fp8}' with parallel.tp = {tp}: {name} = {width} splits into "
        f"shards of {width / tp:.4g} features, not a multiple of the {block}-element scale "
        f"block; each shard must be a multiple of {block} (the width a multiple of "
        f"{block * tp}) so scale blocks do not straddle ranks"
        for name, width in m.tp_split_widths().items()
        if width > 0 and (width % tp or (width // tp) % block)
    ]
