"""Hardware profiles and clusters: the hardware numbers every planner cost is made of.

A `HardwareProfile` is data: datasheet peaks of one accelerator and its usual node's links,
and the efficiencies that turn a peak into what software reaches. Built-in profiles
(`profiles.py`) say where every number comes from (``sources``).

- GEMMs by shape (`kernels.GemmModel`: tile and wave quantization over the SMs, split-K, a
  small-K penalty; FP8 at ``fp8_speedup``), each of a linear's three training forms (x wᵀ,
  g w, gᵀ x) at its own shape, under a memory roofline. A calibrated profile's measured
  shapes (``gemm_table``) win where a GEMM matches one within 5% on every dimension (CPU
  profiles, which have no SM model, take the nearest). Without a model: ``gemm_eff`` times
  a saturating factor of the smallest dimension (the planner's earlier form).
- Flash attention by sequence length, head dim and the kernel's query rows
  (`kernels.AttentionModel`), or a calibrated table by length, or the flat
  ``attn_fwd_eff``/``attn_bwd_eff``.
- Public per-shape kernel measurements win over the models where a shape matches one within
  5% on every key (``linear_table``: a linear's three GEMMs; ``grouped_table``: grouped
  GEMMs by group count; ``attn_shape_table``: attention by sequence, heads and head dim):
  the b200 profile's come from `measured_b200`.
- Memory-bound kernels at ``hbm_gbs x mem_eff`` (a STREAM-like copy), the activation-sized
  elementwise ones at ``elementwise_eff`` of that, dtype casts at ``cast_eff``.
- Collectives on the link tier of their group (`network.py`, `collectives.py`).

`roofline` strips every efficiency: the bound no run can beat, which reports show beside the
realistic prediction. `hyperloom plan calibrate` measures a profile on the machine at hand
and saves it as JSON (`load_profile`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperloom.planner.errors import PlanError
from hyperloom.planner.kernels import AttentionModel, GemmModel, gemm_forms

GIB = 1024**3
_SHAPE_TABLES = ("linear_table", "grouped_table", "attn_shape_table")
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
    # TransformerEngine's fused MoE permutation and un-permutation (and the weighted combine)
    # as a share of the HBM peak, where measured (`measured_b200`, `measured_a100_pcie`);
    # 0 = at the elementwise rate like the other memory-bound kernels.
    permute_eff: float = 0.0
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
    # Fixed seconds (us) per call of a layer's memory-bound modules (norms, activations, MoE
    # routing) on top of their bytes (`launches.py`); 0 unless a public figure is taken
    kernel_latency_us: float = 0.0
    # Seconds a blocking collective (or pipeline receive) of CPU ranks spends beyond its wire
    # time when the ranks compute between calls, as a training step does: the ranks share the
    # cores, so one arrives first and waits for the other to be scheduled and catch up.
    # `calibrate` measures it on CPU (`measure_collectives`, "in step"); 0 where collectives
    # run asynchronously on a device stream (the datasheet profiles, calibrated GPUs).
    collective_wait_us: float = 0.0
    # Shape-aware kernels (`kernels.py`): the GEMM tile/wave model and the flash-attention
    # model by length and head dim; None keeps the flat factors above.
    gemm_model: GemmModel | None = None
    attn_model: AttentionModel | None = None
    # Public per-shape kernel measurements (`measured_b200.py`), each matched when every key is
    # within 5% (`match_shape`), before the models above: a linear's three GEMMs by its forward
    # (m, n, k) -> (fwd, dgrad, wgrad); grouped GEMMs by (groups, m, n, k) -> the same; flash
    # attention by (seq, heads, qk head dim) -> (fwd, bwd), on executed FLOPs.
    linear_table: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] = field(default=())
    grouped_table: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] = field(default=())
    attn_shape_table: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] = field(default=())
    # The link tiers (`network.TIERS`) of the scale-up fabric and the NICs; "" = plain rings.
    intra_tier: str = ""
    inter_tier: str = ""
    # Where each number comes from: (field, source) pairs (`profiles.py`).
    sources: tuple[tuple[str, str], ...] = field(default=())
    # The share of its kernels' isolated speed a training step sustains (clocks under
    # sustained power, SMs shared with overlapped collectives, gaps between kernels): a
    # factor on every compute and memory rate (`simulate.effective_profile`). 1 for
    # calibrated profiles, whose kernels are timed as a step runs them.
    step_eff: float = 1.0

    @property
    def host_memory(self) -> tuple[float, float, float]:
        """(resident per live byte, fixed resident bytes, resident per churned byte)."""
        return self.host_alloc_factor, self.host_runtime_bytes, self.host_churn_factor

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_tflops > 0

    def _measured(self, m: float, n: float, k: float) -> float | None:
        """A calibrated table's efficiency for this shape: the nearest measured one (in log
        space), which with a GEMM model must match within 5% on every dimension."""
        if not self.gemm_table:
            return None
        key = (math.log(max(m, 1)), math.log(max(n, 1)), math.log(max(k, 1)))
        shape, eff = min(
            self.gemm_table,
            key=lambda e: sum((math.log(a) - b) ** 2 for a, b in zip(e[0], key, strict=True)),
        )
        if self.gemm_model is not None:
            close = all(abs(math.log(a) - b) < 0.05 for a, b in zip(shape, key, strict=True))
            return eff if close else None
        return eff

    def gemm_efficiency(self, m: float, n: float, k: float) -> float:
        """Fraction of the BF16 peak a GEMM of this shape reaches (before the roofline)."""
        measured = self._measured(m, n, k)
        if measured is not None:
            return measured
        if self.gemm_model is not None:
            return self.gemm_model.efficiency(m, n, k)
        d = max(min(m, n, k), 1.0)
        g = (d / (d + _D_HALF)) / (_D_REF / (_D_REF + _D_HALF))
        return self.gemm_eff * min(1.0, g)

    def gemm_time(
        self,
        m: float,
        n: float,
        k: float,
        fp8: bool = False,
        count: float = 1,
        eff: float | None = None,
    ) -> float:
        """Seconds for `count` GEMMs (m x k) @ (k x n): roofline of FLOPs and operand bytes,
        at efficiency `eff` (a measured one) or the shape's (`gemm_efficiency`)."""
        flops = 2.0 * m * n * k * count
        rate = self.bf16_tflops * 1e12 * (eff or self.gemm_efficiency(m, n, k))
        if fp8 and self.supports_fp8:
            rate *= self.fp8_speedup
        width = 1 if fp8 and self.supports_fp8 else 2
        moved = (width * (m * k + k * n) + 2 * m * n) * count
        return max(flops / rate, self.memory_time(moved))

    def gemm_times(
        self, m: float, n: float, k: float, fp8: bool = False, count: float = 1, groups: float = 0
    ) -> tuple[float, float, float]:
        """(forward, data-gradient, weight-gradient) seconds of a linear whose forward is
        (m x k) @ (k x n): the backward forms are (m x n) @ (n x k) and (n x m) @ (m x k), each
        at its own shape under the GEMM model; the same time thrice without one. A linear (or
        a grouped GEMM of `groups` groups) in the measured tables takes its three measured
        efficiencies."""
        if groups:
            measured = match_shape(self.grouped_table, (groups, m, n, k))
        else:
            measured = match_shape(self.linear_table, (m, n, k))
        if measured is not None:
            forms = zip(gemm_forms(m, n, k), measured, strict=True)
            f, b, w = (self.gemm_time(*shape, fp8, count, e) for shape, e in forms)
            return f, b, w
        if self.gemm_model is None:
            f = self.gemm_time(m, n, k, fp8, count)
            return f, f, f
        f, b, w = (self.gemm_time(*shape, fp8, count) for shape in gemm_forms(m, n, k))
        return f, b, w

    def memory_time(self, nbytes: float) -> float:
        """Seconds to stream `nbytes` through device memory at the achievable bandwidth."""
        return nbytes / (self.hbm_gbs * 1e9 * self.mem_eff)

    def elementwise_time(self, nbytes: float) -> float:
        """Seconds of activation elementwise kernels moving `nbytes` (``elementwise_eff``)."""
        return self.memory_time(nbytes) / self.elementwise_eff

    def permute_time(self, nbytes: float) -> float:
        """Seconds of the MoE token permutation moving `nbytes` (``permute_eff``, else the
        elementwise rate)."""
        if self.permute_eff:
            return nbytes / (self.hbm_gbs * 1e9 * self.permute_eff)
        return self.elementwise_time(nbytes)

    def cast_time(self, nbytes: float) -> float:
        """Seconds of dtype conversions moving `nbytes` (``cast_eff``)."""
        return self.memory_time(nbytes) / self.cast_eff

    def attention_time(
        self,
        flops: float,
        backward: bool = False,
        seq: float = 0.0,
        head_dim: float = 0.0,
        heads: float = 0.0,
    ) -> float:
        """Seconds of flash attention's `flops`: a measured shape (`attn_shape_table`, by
        `seq`, `heads` -- query heads per sequence the kernel sees -- and `head_dim`), else
        a calibrated table by `seq`, else the attention model by `seq`, `head_dim` and the
        kernel's query rows (seq x heads), else the flat factors."""
        fwd, bwd = self.attn_fwd_eff, self.attn_bwd_eff
        measured = match_shape(self.attn_shape_table, (seq, heads, head_dim)) if heads else None
        if measured is not None:
            return flops / (self.bf16_tflops * 1e12 * measured[1 if backward else 0])
        if self.attn_table and seq > 0:
            _, fwd, bwd = min(self.attn_table, key=lambda e: abs(math.log(e[0] / seq)))
        elif self.attn_model is not None and seq > 0:
            rows = seq * heads
            eff = self.attn_model.efficiency(seq, head_dim or 128.0, backward, rows)
            return flops / (self.bf16_tflops * 1e12 * eff)
        return flops / (self.bf16_tflops * 1e12 * (bwd if backward else fwd))

    def source_of(self, name: str) -> str:
        """Where the profile's `name` comes from (its ``sources`` entry, or ``source``)."""
        return next((text for k, text in self.sources if k == name), self.source)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gemm_table"] = [{"m": s[0], "n": s[1], "k": s[2], "eff": e} for s, e in self.gemm_table]
        d["attn_table"] = [{"seq": q, "fwd": f, "bwd": b} for q, f, b in self.attn_table]
        d["collective_scale"] = dict(self.collective_scale)
        d["gemm_model"] = self.gemm_model.to_dict() if self.gemm_model else None
        d["attn_model"] = self.attn_model.to_dict() if self.attn_model else None
        d["sources"] = dict(self.sources)
        for name in _SHAPE_TABLES:
            d[name] = [[list(k), list(v)] for k, v in getattr(self, name)]
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
        gemm_model, attn_model = d.pop("gemm_model", None), d.pop("attn_model", None)
        sources = d.pop("sources", {}) or {}
        try:
            for name in _SHAPE_TABLES:
                rows = d.pop(name, []) or []
                d[name] = tuple((tuple(map(float, k)), tuple(map(float, v))) for k, v in rows)
            rows = tuple(((int(r["m"]), int(r["n"]), int(r["k"])), float(r["eff"])) for r in table)
            seqs = tuple((int(r["seq"]), float(r["fwd"]), float(r["bwd"])) for r in attn)
            kinds = tuple(sorted((str(k), float(v)) for k, v in dict(scale).items()))
            return cls(
                **d,
                gemm_table=rows,
                attn_table=seqs,
                collective_scale=kinds,
                gemm_model=GemmModel.from_dict(gemm_model) if gemm_model else None,
                attn_model=AttentionModel.from_dict(attn_model) if attn_model else None,
                sources=tuple((str(k), str(v)) for k, v in dict(sources).items()),
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise PlanError(f"bad accelerator profile: {exc}") from None


def match_shape(
    table: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...], key: tuple[float, ...]
) -> tuple[float, ...] | None:
    """The values of the first entry of `table` whose key is within 5% of `key` on every
    dimension (a measured kernel of this shape), or None."""
    for shape, values in table:
        if all(abs(a - b) <= 0.05 * max(a, b) for a, b in zip(shape, key, strict=True)):
            return values
    return None


def roofline(acc: HardwareProfile) -> HardwareProfile:
    """`acc` with every efficiency at 1: datasheet peaks for GEMMs and attention, full HBM
    bandwidth, datasheet links, no latency or host overhead. A plan on it is the bound no run
    can beat, shown beside the realistic prediction."""
    return dataclasses.replace(
        acc,
        gemm_eff=1.0,
        gemm_table=(),
        gemm_model=GemmModel.ideal(),
        attn_fwd_eff=1.0,
        attn_bwd_eff=1.0,
        attn_table=(),
        attn_model=None,
        linear_table=(),
        grouped_table=(),
        attn_shape_table=(),
        mem_eff=1.0,
        elementwise_eff=1.0,
        cast_eff=1.0,
        permute_eff=0.0,
        intra_eff=1.0,
        inter_eff=1.0,
        intra_latency_us=0.0,
        inter_latency_us=0.0,
        intra_tier="",
        inter_tier="",
        collective_scale=(),
        layer_overhead_s=0.0,
        kernel_latency_us=0.0,
        collective_wait_us=0.0,
        step_eff=1.0,
    )


def __getattr__(name: str) -> Any:
    """`PROFILES`, the built-in profiles, live in `profiles.py` (they are data)."""
    if name == "PROFILES":
        from hyperloom.planner.profiles import PROFILES

        return PROFILES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_profile(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name (`profiles.PROFILES`), or a saved profile (JSON from
    `plan calibrate`)."""
    from hyperloom.planner.profiles import PROFILES

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
