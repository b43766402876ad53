"""Network tiers: what each collective gets from the link it runs on.

A profile names the tier of its scale-up fabric (``intra_tier``: NVLink/NVSwitch, PCIe,
Infinity Fabric, MTLink) and of its scale-out network (``inter_tier``: InfiniBand or RoCE
NICs). Its ``intra_gbs x intra_eff`` and ``nic_gbs x inter_eff`` are the all-reduce's bus
bandwidth at large messages (nccl-tests' ``busbw``, doc/PERFORMANCE.md); a tier adds what
differs per collective and per group:

- ``relative``: each collective's bus bandwidth over the all-reduce's on this tier (NCCL's
  all-to-all sends one message per peer and, across nodes, meets congestion a ring avoids);
- ``per_doubling``: bus bandwidth lost per doubling of the group beyond two ranks, where the
  ranks share one bottleneck (on PCIe every flow crosses the CPU's root complex and memory:
  "on PCI systems, the performance you get is usually determined by the bandwidth your CPU
  and memory can deliver", NVIDIA/nccl#1639, where 8 GPUs reach 28 GB/s and 4 reach 35);
- ``latency_us``: a collective's per-step latency where it differs from the link's;
- ``fixed_us``: a collective's latency paid once per call whatever the group (launch, the
  protocol's setup), where measured: nccl-tests fitted as ``fixed + steps x latency + bytes /
  bandwidth`` (SimuMax's ``nccl_fit.py`` form);
- ``straggle``: a collective over k nodes waits for the slowest of them; its time grows by
  ``straggle x log2(k)`` (SimuMax's log-n factor; MegaScale, arXiv 2402.15627 §4, and the
  Llama 3 report, arXiv 2407.21783 §3.3.4, describe stragglers at scale).
- ``sized``: measured per group size, where a fabric's groups differ by more than a per-doubling
  loss (a PCIe node's two or four GPUs under one switch, eight across the sockets): (ranks,
  kind, bus bandwidth over the profile's link, per-step latency us); a group takes the
  smallest measured size that holds it, in place of ``relative``, ``per_doubling`` and
  ``latency_us``;
- ``shared``: the ranks of a node share one bottleneck (PCIe's root complex and host
  memory), so groups whose ranks interleave with others' (a data-parallel group spaced tp
  apart) run at the same time over the same span: each gets the span's bandwidth (the
  group-size loss of all its ranks) over the number of such groups (`collectives.group_link`).

An empty tier name keeps the plain ring model (calibrated profiles: their measured
`collective_scale` plays the part of ``relative``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hyperloom.planner import measured_a100_pcie as MA100P
from hyperloom.planner import measured_b200 as MB200
from hyperloom.planner.errors import PlanError


@dataclass(frozen=True)
class Tier:
    """A link technology's per-collective behaviour (module docstring)."""

    name: str
    relative: tuple[tuple[str, float], ...] = ()
    per_doubling: float = 0.0
    latency_us: tuple[tuple[str, float], ...] = ()
    fixed_us: tuple[tuple[str, float], ...] = ()
    straggle: float = 0.0
    sized: tuple[tuple[int, str, float, float], ...] = ()
    shared: bool = False
    source: str = ""

    def efficiency(self, kind: str) -> float:
        """Bus bandwidth of `kind` over the all-reduce's (1 where not listed)."""
        return next((f for k, f in self.relative if k == kind), 1.0)

    def group_factor(self, n: int) -> float:
        """Bus bandwidth of an n-rank group over a 2-rank one."""
        return (1.0 - self.per_doubling) ** max(0.0, math.log2(max(n, 2)) - 1.0)

    def at_size(self, n: int) -> dict[str, tuple[float, float]]:
        """kind -> (bus bandwidth over the link's, per-step latency us) measured for the
        smallest group of at least `n` ranks (the largest measured beyond them); {} when the
        tier is not `sized`."""
        sizes = sorted({m for m, *_ in self.sized})
        if not sizes:
            return {}
        m = next((m for m in sizes if m >= n), sizes[-1])
        return {kind: (rel, us) for size, kind, rel, us in self.sized if size == m}

    def straggler(self, nodes: int) -> float:
        """Factor on a collective's time over `nodes` nodes (1 inside one)."""
        return 1.0 + self.straggle * math.log2(nodes) if nodes > 1 else 1.0


LEGACY = Tier("ring")

TIERS: dict[str, Tier] = {
    "nvlink": Tier(
        "nvlink",
        relative=(("all_to_all", 0.85), ("p2p", 0.9)),
        source="NVSwitch: nccl-tests' bus bandwidth does not fall with the group (8 A100 SXM: "
        "208-233 GB/s all-reduce of 300, NVIDIA/nccl-tests#149, #175, #178); all-to-all: "
        "DeepEP's tuned kernels reach 153 of 160 GB/s (H800) and 726 of 900 (B200), NCCL's "
        "per-peer sends less: 0.85 assumed; p2p 0.9 assumed",
    ),
    # B200's NVLink5 from nccl-tests on one DGX B200 node, fitted per collective by SimuMax
    # (`measured_b200.NCCL_FIT`): each kind's own bus efficiency over the all-reduce's, its
    # per-step and its once-per-call latency. The all-to-all's fixed part depends on the group
    # in that fit (51 us at 2 ranks, 19 at 4, 0 at 8); the 8-rank value is kept (module
    # `measured_b200` says why).
    "nvlink5": Tier(
        "nvlink5",
        relative=tuple(
            (k, MB200.NCCL_FIT[k][0] / MB200.NCCL_FIT["all_reduce"][0])
            for k in ("all_gather", "reduce_scatter", "all_to_all")
        )
        + (("p2p", 0.9),),
        latency_us=tuple((k, v[1]) for k, v in MB200.NCCL_FIT.items()),
        fixed_us=tuple((k, v[2]) for k, v in MB200.NCCL_FIT.items()),
        source=f"{MB200.NCCL_SOURCE}; p2p 0.9 assumed as NVSwitch's",
    ),
    "pcie": Tier(
        "pcie",
        relative=(("all_to_all", 0.8), ("p2p", 1.0)),
        per_doubling=0.2,
        latency_us=(("all_reduce", 8.0), ("all_gather", 8.0), ("reduce_scatter", 8.0)),
        shared=True,
        source="PCIe through the CPU: the group shares the root complex and host memory; "
        "8 GPUs all-reduce at 28 GB/s against 35 for 4 on PCIe 5 x16 (64 GB/s a direction; "
        "NVIDIA/nccl#1639), so 20% per doubling and 0.55 of the link at 4 ranks, 0.68 at 2; "
        "interleaved groups share the span they cover; step latency 8 us assumed",
    ),
    # One 8-GPU A100 PCIe node, measured: SimuMax's nccl-tests fits per collective and group
    # size (`measured_a100_pcie.NCCL_FIT`), each bus bandwidth over the 2-rank all-reduce's
    # (the profile's link); 2 and 4 ranks share a PCIe switch, 8 cross the sockets.
    "pcie-a100": Tier(
        "pcie-a100",
        sized=tuple(
            (n, kind, eff / MA100P.NCCL_FIT[2]["all_reduce"][0], us)
            for n, fits in MA100P.NCCL_FIT.items()
            for kind, (eff, us) in fits.items()
        ),
        shared=True,
        source=f"{MA100P.NCCL_SOURCE}; interleaved groups share the span they cover",
    ),
    "xgmi": Tier(
        "xgmi",
        relative=(("all_to_all", 0.8), ("p2p", 0.9)),
        source="MI300X Infinity Fabric, fully connected (7 x 64 GB/s): per-collective "
        "factors assumed like NVSwitch's, all-to-all a little lower",
    ),
    "mtlink": Tier(
        "mtlink",
        relative=(("all_to_all", 0.8), ("p2p", 0.9)),
        source="MTT S4000 MTLink: no published collective figures; NVSwitch-like factors assumed",
    ),
    "ib": Tier(
        "ib",
        relative=(("all_to_all", 0.7), ("p2p", 1.0)),
        straggle=0.02,
        source="InfiniBand/RoCE NICs: NCCL reaches ~24 of 25 GB/s per 200 Gb/s NIC "
        "(NVIDIA/nccl-tests#119, 84.8-96 GB/s on 4 NICs); all-to-all across nodes 0.7 of it "
        "assumed (DeepEP's forwarding kernels reach 43-58 GB/s per 50 GB/s NIC, plain NCCL "
        "sends every copy per peer); straggle 2% per doubling of nodes assumed",
    ),
}


def get_tier(name: str) -> Tier:
    """A tier by name ("" = the plain ring model)."""
    if not name:
        return LEGACY
    if name not in TIERS:
        raise PlanError(f"unknown network tier {name!r}; known: {', '.join(TIERS)}")
    return TIERS[name]
