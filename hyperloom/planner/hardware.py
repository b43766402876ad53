"""Hardware profiles and clusters: the hardware numbers every planner cost is made of.

A `HardwareProfile` is data: datasheet peaks of one accelerator and its usual node's links,
and efficiency factors that turn a peak into what software reaches (a GEMM runs at
``peak * gemm_eff * shape factor``, a memory-bound kernel at ``hbm * mem_eff``, a collective
at ``link * link_eff``). `hyperloom plan calibrate` measures these on the machine at hand and
saves them as JSON (`load_profile`).

Sources (each profile's ``source`` repeats them): vendor datasheets for peaks (dense, i.e.
2:4-sparsity headlines halved), memory (as the device reports it, GiB) and links (per GPU, per
direction); ``gemm_eff`` from stas00/ml-engineering's MAMF table; ``fp8_speedup`` 1.55 from
TransformerEngine's H200 GEMMs; flash-attention, ``mem_eff`` and link efficiencies are our
stated assumptions (FlashAttention-2/3 papers as guides), which is what `calibrate` is for.
The table is in docs/planner.md.

GEMM shape factor: ``eff = gemm_eff * g(min(m, n, k))``, ``g(d) = (d / (d + 128)) /
(2048 / (2048 + 128))`` capped at 1, under a memory roofline; a calibrated profile looks up
its nearest measured shape instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperloom.planner.errors import PlanError

GIB = 1024**3
_D_REF, _D_HALF = 2048.0, 128.0


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator and the links of the node it usually sits in."""

    name: str
    bf16_tflops: float  # dense peak
    fp8_tflops: float  # dense peak; 0 = no FP8 tensor cores
    hbm_gib: float  # usable device memory, GiB
    hbm_gbs: float  # device memory bandwidth, GB/s
    gemm_eff: float  # MAMF / peak for large BF16 GEMMs
    fp8_speedup: float = 1.55  # FP8 GEMM speed over BF16 at equal shape
    attn_fwd_eff: float = 0.6  # flash attention forward, fraction of BF16 peak
    attn_bwd_eff: float = 0.45
    mem_eff: float = 0.8  # fraction of HBM bandwidth memory-bound kernels reach
    intra_gbs: float = 450.0  # scale-up bandwidth per GPU per direction, GB/s
    intra_eff: float = 0.8
    intra_latency_us: float = 1.5
    nic_gbs: float = 50.0  # scale-out bandwidth per GPU per direction, GB/s
    inter_eff: float = 0.9
    inter_latency_us: float = 5.0
    gpus_per_node: int = 8
    # A CPU process's resident bytes beyond its live tensors at a rank's peak (`host_memory`):
    # ``host_runtime_bytes`` that do not grow with the job (compiled kernels' code and heap,
    # the compiler's Python objects) plus ``host_churn_factor`` per byte a step allocates and
    # frees (the heap's freed-but-kept pages), both measured by `plan calibrate`; and an older
    # form, ``host_alloc_factor`` resident bytes per live byte, which older saved profiles
    # carry. Device memory: 1, 0 and 0.
    host_alloc_factor: float = 1.0
    host_runtime_bytes: float = 0.0
    host_churn_factor: float = 0.0
    source: str = ""
    # Calibrated GEMM efficiencies: ((m, n, k), eff) pairs, nearest shape wins.
    gemm_table: tuple[tuple[tuple[int, int, int], float], ...] = field(default=())
    # Activation-sized elementwise kernels (norms, activation, RoPE, residual adds, the
    # loss's softmax) relative to ``mem_eff``: they allocate fresh outputs and some are
    # arithmetic-bound on CPUs, unlike a copy or the optimizer's in-place streams.
    # `calibrate` measures it; 1.0 (the same as a copy) for the datasheet profiles.
    elementwise_eff: float = 1.0
    # Dtype conversions (autocast's FP32 -> BF16 casts of weights and linear inputs, and their
    # gradients' casts back) relative to ``mem_eff``: eager, unfused, and on CPUs slower than
    # a copy. `calibrate` measures it; 1.0 for the datasheet profiles.
    cast_eff: float = 1.0
    # Calibrated attention by sequence length: (seq, fwd_eff, bwd_eff), nearest seq wins
    # over ``attn_fwd_eff``/``attn_bwd_eff`` (flash kernels get faster with longer rows).
    attn_table: tuple[tuple[int, float, float], ...] = field(default=())
    # Measured (collective kind, factor on the ring model's bandwidth term) next to the
    # all-reduce the link figures come from; empty for the datasheet profiles (rings).
    collective_scale: tuple[tuple[str, float], ...] = field(default=())
    # Host seconds per transformer layer per micro-batch (forward + backward) that no kernel
    # accounts for: Python, the dispatcher, autograd, kernel launches. `calibrate` measures
    # it (`measure_layer_overhead`); 0 for the datasheet profiles (large layers hide it).
    layer_overhead_s: float = 0.0
    # Seconds a blocking collective (or pipeline receive) of CPU ranks spends beyond its wire
    # time when the ranks compute between calls, as a training step does: the ranks share the
    # cores, so one arrives first and waits for the other to be scheduled and catch up.
    # `calibrate` measures it on CPU (`measure_collectives`, "in step"); 0 where collectives
    # run asynchronously on a device stream (the datasheet profiles, calibrated GPUs).
    collective_wait_us: float = 0.0

    @property
    def host_memory(self) -> tuple[float, float, float]:
        """(resident per live byte, fixed resident bytes, resident per churned byte)."""
        return self.host_alloc_factor, self.host_runtime_bytes, self.host_churn_factor

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_tflops > 0

    def gemm_efficiency(self, m: float, n: float, k: float) -> float:
        """Fraction of the BF16 peak a GEMM of this shape reaches (before the roofline)."""
        if self.gemm_table:
            key = (math.log(max(m, 1)), math.log(max(n, 1)), math.log(max(k, 1)))
            best = min(
                self.gemm_table,
                key=lambda e: sum((math.log(a) - b) ** 2 for a, b in zip(e[0], key, strict=True)),
            )
            return best[1]
        d = max(min(m, n, k), 1.0)
        g = (d / (d + _D_HALF)) / (_D_REF / (_D_REF + _D_HALF))
        return self.gemm_eff * min(1.0, g)

    def gemm_time(self, m: float, n: float, k: float, fp8: bool = False, count: float = 1) -> float:
        """Seconds for `count` GEMMs (m x k) @ (k x n): roofline of FLOPs and operand bytes."""
        flops = 2.0 * m * n * k * count
        rate = self.bf16_tflops * 1e12 * self.gemm_efficiency(m, n, k)
        if fp8 and self.supports_fp8:
            rate *= self.fp8_speedup
        width = 1 if fp8 and self.supports_fp8 else 2
        moved = (width * (m * k + k * n) + 2 * m * n) * count
        return max(flops / rate, self.memory_time(moved))

    def memory_time(self, nbytes: float) -> float:
        """Seconds to stream `nbytes` through device memory at the achievable bandwidth."""
        return nbytes / (self.hbm_gbs * 1e9 * self.mem_eff)

    def elementwise_time(self, nbytes: float) -> float:
        """Seconds of activation elementwise kernels moving `nbytes` (``elementwise_eff``)."""
        return self.memory_time(nbytes) / self.elementwise_eff

    def cast_time(self, nbytes: float) -> float:
        """Seconds of dtype conversions moving `nbytes` (``cast_eff``)."""
        return self.memory_time(nbytes) / self.cast_eff

    def attention_time(self, flops: float, backward: bool = False, seq: float = 0.0) -> float:
        """Seconds of flash attention's `flops`; a calibrated profile looks up `seq`."""
        fwd, bwd = self.attn_fwd_eff, self.attn_bwd_eff
        if self.attn_table and seq > 0:
            _, fwd, bwd = min(self.attn_table, key=lambda e: abs(math.log(e[0] / seq)))
        return flops / (self.bf16_tflops * 1e12 * (bwd if backward else fwd))

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gemm_table"] = [{"m": s[0], "n": s[1], "k": s[2], "eff": e} for s, e in self.gemm_table]
        d["attn_table"] = [{"seq": q, "fwd": f, "bwd": b} for q, f, b in self.attn_table]
        d["collective_scale"] = dict(self.collective_scale)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"profile has unknown keys {unknown}; known: {sorted(known)}")
        d = dict(d)
        table = d.pop("gemm_table", []) or []
        attn = d.pop("attn_table", []) or []
        scale = d.pop("collective_scale", {}) or {}
        try:
            rows = tuple(((int(r["m"]), int(r["n"]), int(r["k"])), float(r["eff"])) for r in table)
            seqs = tuple((int(r["seq"]), float(r["fwd"]), float(r["bwd"])) for r in attn)
            kinds = tuple(sorted((str(k), float(v)) for k, v in dict(scale).items()))
            return cls(**d, gemm_table=rows, attn_table=seqs, collective_scale=kinds)
        except (TypeError, KeyError, ValueError) as exc:
            raise PlanError(f"bad accelerator profile: {exc}") from None


_NV_SOURCE = "NVIDIA datasheet; gemm_eff from stas00/ml-engineering MAMF; see hardware.py"

PROFILES: dict[str, HardwareProfile] = {
    # H100 SXM5 80GB: 989.4 BF16 / 1978.9 FP8 dense, HBM3 3.35 TB/s, NVLink4 900 GB/s
    # bidirectional, DGX H100 8x ConnectX-7 400 Gb/s (one per GPU).
    "h100": HardwareProfile("h100", 989.4, 1978.9, 80.0, 3350, 792.1 / 989.4, source=_NV_SOURCE),
    # H200 SXM 141GB: H100 compute, HBM3e 4.8 TB/s.
    "h200": HardwareProfile("h200", 989.4, 1978.9, 140.0, 4800, 794.5 / 989.4, source=_NV_SOURCE),
    # A100 SXM4 80GB: 312 BF16, no FP8, HBM2e 2.039 TB/s, NVLink3 600 GB/s bidirectional,
    # DGX A100 8x ConnectX-6 HDR 200 Gb/s.
    "a100": HardwareProfile(
        "a100",
        312.0,
        0.0,
        80.0,
        2039,
        267.9 / 312.0,
        intra_gbs=300.0,
        nic_gbs=25.0,
        source=_NV_SOURCE,
    ),
    # B200 (DGX B200): 2.25 PF BF16 / 4.5 PF FP8 dense, 180 GB HBM3e at 8 TB/s, NVLink5
    # 1.8 TB/s bidirectional, 8x ConnectX-7 400 Gb/s.
    "b200": HardwareProfile(
        "b200",
        2250.0,
        4500.0,
        179.0,
        8000,
        1745.0 / 2250.0,
        intra_gbs=900.0,
        source=_NV_SOURCE,
    ),
    # MI300X: 1307.4 BF16 / 2614.9 FP8 dense, 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric
    # links of 64 GB/s each way (448 GB/s), platform NICs 400 Gb/s per GPU.
    "mi300x": HardwareProfile(
        "mi300x",
        1307.4,
        2614.9,
        192.0,
        5300,
        781.9 / 1300.0,
        attn_fwd_eff=0.4,
        attn_bwd_eff=0.3,
        intra_gbs=448.0,
        intra_eff=0.7,
        source="AMD MI300X datasheet; MAMF from stas00/ml-engineering; link effs assumed",
    ),
    # MTT S4000: 100 TFLOPS BF16 (FP8 not listed), 48 GB GDDR6 at 768 GB/s, MTLink 240 GB/s
    # (taken as bidirectional). One 200 Gb/s RoCE NIC per GPU and every efficiency assumed.
    "mtt-s4000": HardwareProfile(
        "mtt-s4000",
        100.0,
        0.0,
        48.0,
        768,
        0.6,
        attn_fwd_eff=0.4,
        attn_bwd_eff=0.3,
        intra_gbs=120.0,
        intra_eff=0.7,
        nic_gbs=25.0,
        source="Moore Threads S4000 product page; efficiencies are placeholders",
    ),
}


def get_profile(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name, or a saved profile (JSON from `plan calibrate`)."""
    key = name_or_path.lower()
    if key in PROFILES:
        return PROFILES[key]
    if key.endswith(".json"):
        return load_profile(name_or_path)
    raise PlanError(
        f"unknown accelerator {name_or_path!r}; built in: {', '.join(PROFILES)} "
        f"(or a .json profile written by `hyperloom plan calibrate`)"
    )


def save_profile(
    acc: HardwareProfile, path: str | Path, extra: dict[str, Any] | None = None
) -> Path:
    """Write `acc` as JSON (plus `extra` measurements under "measurements")."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = {"accelerator": acc.to_dict(), "measurements": extra or {}}
    p.write_text(json.dumps(body, indent=2) + "\n")
    return p


def load_profile(path: str | Path) -> HardwareProfile:
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"accelerator profile '{p}' does not exist")
    try:
        body = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise PlanError(f"accelerator profile '{p}' is not JSON: {exc}") from None
    return HardwareProfile.from_dict(body.get("accelerator", body))


@dataclass(frozen=True)
class Cluster:
    """`gpus` accelerators of one kind, `gpus_per_node` of them behind one scale-up fabric."""

    profile: HardwareProfile
    gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise PlanError(f"need gpus >= 1 and gpus per node >= 1, got {self}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlanError(
                f"{self.gpus} GPUs is not a whole number of {self.gpus_per_node}-GPU nodes: "
                f"{self.gpus} / {self.gpus_per_node} = {self.gpus / self.gpus_per_node:.4g}"
            )

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @classmethod
    def of(
        cls, profile: str | HardwareProfile, gpus: int, gpus_per_node: int | None = None
    ) -> Cluster:
        """`gpus` of a built-in or saved profile (by name or path), or of `profile` itself."""
        hw = get_profile(profile) if isinstance(profile, str) else profile
        return cls(hw, gpus, gpus_per_node or hw.gpus_per_node)
