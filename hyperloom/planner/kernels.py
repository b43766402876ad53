"""Kernel efficiency by shape: GEMMs by tile and wave quantization, attention by length.

A GEMM's time is not its FLOPs over one efficiency factor. cuBLAS and CUTLASS cut the
(m x n) output into thread-block tiles (typically 256x128, 128x256, 128x128, 256x64,
64x256, 128x64, 64x128, 64x64; larger tiles reuse more data and run faster) and run the tiles
in waves over the device's SMs (NVIDIA, "Matrix Multiplication Background User's Guide",
DU-09799-001, §2.3 and §3). Two quantizations follow: a dimension that is not a multiple of
the tile computes padding (*tile quantization*), and a tile count that is not a multiple of
the SM count leaves SMs idle in the last wave (*wave quantization*). When there are fewer
tiles than SMs the library splits K (split-K / stream-K), paying a reduction of the partial
outputs. The K loop has a fixed prologue and epilogue per tile, so a short K runs below the
machine's rate (the *small-dimension penalty*, ``k / (k + k_half)`` relative to K = 2048,
past which the published best shapes no longer gain). `GemmModel` picks, as the library's
heuristics do, the tile with the best product of those factors:

    eff(m, n, k) = peak_eff * max over tiles [ tile_eff * tile_q * wave_q * f_k(k) ]
    f_k(k) = min(1, (k / (k + k_half)) / (2048 / (2048 + k_half)))

``peak_eff`` is the efficiency a large, perfectly quantized GEMM reaches; the built-in
profiles derive it from the published maximum achievable matmul FLOPS (MAMF) at the shape
where it was measured (`derive_peak_eff`), so the model reproduces that measurement there.
`plan calibrate` refits ``peak_eff`` and ``k_half`` on the device at hand from the job's own
GEMM shapes (`fit_gemm_model`). FP8 GEMMs run the same tiles at ``fp8_speedup`` (the
published FP8 over BF16 MAMF ratio).

Attention (`AttentionModel`): flash kernels approach their peak only for long rows, so the
efficiency saturates in the sequence length, ``eff_max * s / (s + seq_half)``, lower for head
dims under 128 (FlashAttention-2, arXiv 2307.08691; FlashAttention-3, arXiv 2407.08608), and
optionally in the kernel's query rows (few heads per rank leave SMs idle);
`fit_attention_model` fits it to measured shapes as `fit_gemm_model` does the GEMM model.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from hyperloom.planner.errors import PlanError

# cuBLAS's typical thread-block tiles (the guide's §2.3) with their relative efficiency. The
# ordering is the guide's (bigger tiles reuse more operands per load); the values are our
# assumption, and only ratios matter: `plan calibrate` fits the absolute level.
NV_TILES: tuple[tuple[int, int, float], ...] = (
    (256, 128, 1.0),
    (128, 256, 1.0),
    (128, 128, 0.92),
    (256, 64, 0.88),
    (64, 256, 0.88),
    (128, 64, 0.8),
    (64, 128, 0.8),
    (64, 64, 0.62),
)
SPLIT_K_COST = 0.05  # efficiency lost per extra K split (the FP32 partials' reduction), assumed
MIN_SPLIT_K = 512  # K per split below which the library does not split further
# The K past which a GEMM no longer speeds up: the published MAMF best shapes have K of 1536
# to 2816 (A100 2048, H100 2816, GH200 1536) although the search ranged far beyond.
K_SATURATION = 2048.0


def _ceil(a: float, b: float) -> int:
    return max(1, math.ceil(a / b - 1e-9))


@functools.lru_cache(maxsize=65536)
def _shape_factor(
    sms: int, k_half: float, tiles: tuple[tuple[int, int, float], ...], m: float, n: float, k: float
) -> float:
    """`GemmModel.shape_factor`, cached: a search meets the same shapes for every schedule,
    recompute policy and micro-batch count of a layout."""
    m, n, k = max(m, 1.0), max(n, 1.0), max(k, 1.0)
    small_k_ref = (K_SATURATION + k_half) / K_SATURATION
    best = 0.0
    for tm, tn, te in tiles:
        rows, cols = _ceil(m, tm), _ceil(n, tn)
        count = rows * cols
        split = 1
        if sms and count < sms:  # split K over idle SMs
            split = max(1, min(sms // count, int(k // MIN_SPLIT_K)))
        work = count * split
        wave_q = work / (_ceil(work, sms) * sms) if sms else 1.0
        kk = k / split
        small_k = min(1.0, kk / (kk + k_half) * small_k_ref)
        f = te * m * n / (count * tm * tn) * wave_q * small_k / (1 + SPLIT_K_COST * (split - 1))
        if f > best:
            best = f
    return best


@dataclass(frozen=True)
class GemmModel:
    """Efficiency of a GEMM of one shape on one device (module docstring)."""

    sms: int  # streaming multiprocessors (compute units) the tiles are spread over
    peak_eff: float  # a large, perfectly quantized GEMM's fraction of the BF16 peak
    k_half: float = 96.0  # K at which the K loop's fixed cost halves the rate
    tiles: tuple[tuple[int, int, float], ...] = NV_TILES
    source: str = ""

    def shape_factor(self, m: float, n: float, k: float) -> float:
        """The best tile's quantization and small-K factor (peak_eff not applied)."""
        return _shape_factor(self.sms, self.k_half, self.tiles, m, n, k)

    def efficiency(self, m: float, n: float, k: float) -> float:
        return self.peak_eff * self.shape_factor(m, n, k)

    @classmethod
    def ideal(cls) -> GemmModel:
        """Every shape at the peak: no tiles to pad, no waves, no K penalty (the roofline)."""
        return cls(0, 1.0, 0.0, ((1, 1, 1.0),), "roofline")

    def to_dict(self) -> dict[str, Any]:
        return {
            "sms": self.sms,
            "peak_eff": self.peak_eff,
            "k_half": self.k_half,
            "tiles": [list(t) for t in self.tiles],
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GemmModel:
        try:
            tiles = tuple((int(a), int(b), float(c)) for a, b, c in d.get("tiles", NV_TILES))
            return cls(
                int(d["sms"]),
                float(d["peak_eff"]),
                float(d.get("k_half", 96.0)),
                tiles,
                str(d.get("source", "")),
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise PlanError(f"bad gemm_model in profile: {exc!r}") from None


def gemm_forms(m: float, n: float, k: float) -> tuple[tuple[float, float, float], ...]:
    """A linear's three training GEMMs as (rows, cols, inner), its forward being (m x k) @
    (k x n): forward (m, n, k), data gradient (m x n) @ (n x k) = (m, k, n), weight gradient
    (n x m) @ (m x k) = (n, k, m)."""
    return (m, n, k), (m, k, n), (n, k, m)


def derive_peak_eff(sms: int, mamf_eff: float, shape: tuple[int, int, int], **kw) -> float:
    """The ``peak_eff`` that makes `GemmModel` reproduce a measured efficiency `mamf_eff` at
    `shape` (the published MAMF's best shape): measurement over the shape factor there."""
    return mamf_eff / GemmModel(sms, 1.0, **kw).shape_factor(*shape)


def fit_gemm_model(
    base: GemmModel, samples: list[tuple[tuple[float, float, float], float]]
) -> GemmModel:
    """``peak_eff`` and ``k_half`` of `base` refitted to measured (shape, efficiency) pairs:
    least squares on log efficiency, ``k_half`` on a log grid with ``peak_eff`` in closed form
    (the geometric mean of measured over modelled). Other fields stay."""
    if not samples:
        raise PlanError("fitting a GEMM model needs at least one measured shape")
    best: tuple[float, GemmModel] | None = None
    for i in range(41):  # k_half from 4 to 4096
        k_half = 4.0 * 2 ** (i / 4)
        trial = GemmModel(base.sms, 1.0, k_half, base.tiles, base.source)
        logs = [math.log(e / trial.shape_factor(*s)) for s, e in samples if e > 0]
        if not logs:
            raise PlanError("measured GEMM efficiencies must be positive")
        level = sum(logs) / len(logs)
        loss = sum((v - level) ** 2 for v in logs)
        model = GemmModel(base.sms, math.exp(level), k_half, base.tiles, base.source)
        if best is None or loss < best[0] - 1e-12:
            best = (loss, model)
    return best[1]


@dataclass(frozen=True)
class AttentionModel:
    """Flash attention's fraction of the BF16 peak by sequence length, head dim and the
    kernel's query rows r (seq x heads x batch on one rank):
    ``eff_max * s / (s + seq_half) * min(1, d / 128) ** head_exp * r / (r + rows_half)``
    each way. The last factor is the kernel's parallelism: it runs one thread block per
    (128-row query tile, head), so a rank with few heads (tp 8 of 64) leaves SMs idle and the
    causal triangle's short tiles unbalanced (TE's B200 kernels at 4K tokens: 8 heads reach a
    third of 64 heads' forward rate; `measured_b200.ATTENTION`). 0 = no such loss."""

    fwd_max: float
    bwd_max: float
    seq_half: float = 512.0
    head_exp: float = 0.2
    source: str = ""
    fwd_rows_half: float = 0.0
    bwd_rows_half: float = 0.0

    def efficiency(
        self, seq: float, head_dim: float = 128.0, backward: bool = False, rows: float = 0.0
    ) -> float:
        peak = self.bwd_max if backward else self.fwd_max
        s = max(seq, 1.0)
        d = min(1.0, max(head_dim, 1.0) / 128.0) ** self.head_exp if head_dim else 1.0
        half = self.bwd_rows_half if backward else self.fwd_rows_half
        par = rows / (rows + half) if rows > 0 and half > 0 else 1.0
        return peak * s / (s + self.seq_half) * d * par

    def to_dict(self) -> dict[str, Any]:
        return {
            "fwd_max": self.fwd_max,
            "bwd_max": self.bwd_max,
            "seq_half": self.seq_half,
            "head_exp": self.head_exp,
            "source": self.source,
            "fwd_rows_half": self.fwd_rows_half,
            "bwd_rows_half": self.bwd_rows_half,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionModel:
        try:
            return cls(
                float(d["fwd_max"]),
                float(d["bwd_max"]),
                float(d.get("seq_half", 512.0)),
                float(d.get("head_exp", 0.2)),
                str(d.get("source", "")),
                float(d.get("fwd_rows_half", 0.0)),
                float(d.get("bwd_rows_half", 0.0)),
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise PlanError(f"bad attn_model in profile: {exc!r}") from None


def fit_attention_model(
    samples: list[tuple[tuple[float, float, float], tuple[float, float]]], source: str = ""
) -> AttentionModel:
    """An `AttentionModel` fitted to measured ((seq, heads, head_dim), (fwd, bwd)) pairs:
    least squares on log efficiency, ``seq_half`` and each direction's ``rows_half`` on log
    grids with the maxima in closed form (geometric means of measured over modelled)."""
    if not samples:
        raise PlanError("fitting an attention model needs at least one measured shape")
    grid = [0.0] + [2 ** (i / 2) for i in range(8, 44)]

    def fit(i: int, seq_half: float) -> tuple[float, float, float]:
        best = (math.inf, 0.0, 0.0)
        for half in grid:
            trial = AttentionModel(1.0, 1.0, seq_half, fwd_rows_half=half, bwd_rows_half=half)
            logs = [
                math.log(e[i] / trial.efficiency(s, d, i == 1, s * h)) for (s, h, d), e in samples
            ]
            level = sum(logs) / len(logs)
            loss = sum((v - level) ** 2 for v in logs)
            if loss < best[0] - 1e-12:
                best = (loss, math.exp(level), half)
        return best

    best: tuple[float, AttentionModel] | None = None
    for seq_half in grid[:25]:
        (lf, fmax, fhalf), (lb, bmax, bhalf) = fit(0, seq_half), fit(1, seq_half)
        model = AttentionModel(fmax, bmax, seq_half, 0.2, source, fhalf, bhalf)
        if best is None or lf + lb < best[0] - 1e-12:
            best = (lf + lb, model)
    return best[1]
