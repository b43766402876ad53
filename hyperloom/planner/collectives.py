"""Collective communication times: the alpha-beta ring model, per topology level.

Each collective over a group of n ranks moving a full buffer of S bytes costs, on a ring
(REFERENCE.md §4.4, nccl-tests `doc/PERFORMANCE.md`):

    all-reduce                      2(n-1) alpha + 2 (n-1)/n * S / B
    all-gather, reduce-scatter,     (n-1) alpha  +   (n-1)/n * S / B
    all-to-all
    point-to-point                  alpha + S / B

B is the *bus bandwidth* a rank reaches on the group's slowest link (the datasheet figure
times the link's efficiency) and alpha the latency of one ring step. This is SimuMax's
calibrated form ``S*scale*(1+offset/n)/(B*eff) + alpha*scale*(n+offset) + fixed`` with
(scale, offset) = (2, -1) for all-reduce, (1, -1) for gathers, scatters and all-to-all; a
calibrated profile may set a per-call ``fixed`` cost (kernel launch, protocol set-up).

Which link a group uses follows from the rank order of the mesh (`ParallelConfig.order`,
outermost first, default ``pp,dp,cp,tp``): a dimension's *stride* is the product of the
sizes inside it. A group whose ranks all sit in one node (``size * stride <= gpus/node``) runs
on the scale-up fabric (NVLink, xGMI, MTLink). A group that spans nodes is limited by the
NICs, and the NICs of a node are shared by every group of that dimension that runs at the
same moment: with ``r`` members of the group on each node, ``gpus/node / r`` groups share the
node's ``gpus/node`` NICs, so each group's ring gets ``r`` NICs' worth of bandwidth (SimuMax
divides inter-node DP bandwidth by min(8, tp*cp), which is the same rule). Pipeline
point-to-point across nodes gets one NIC. An all-to-all over k nodes (expert parallelism)
sends (k-1)/k of its bytes through the NICs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperloom.planner.errors import PlanError
from hyperloom.planner.hardware import Cluster

_SCALE = {
    "all_reduce": (2.0, -1.0),
    "all_gather": (1.0, -1.0),
    "reduce_scatter": (1.0, -1.0),
    "all_to_all": (1.0, -1.0),
}
DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Link:
    """What one rank of a group gets: bus bandwidth (bytes/s, efficiency applied), latency."""

    bandwidth: float
    latency: float
    fixed: float = 0.0
    level: str = "intra"  # "intra" (scale-up fabric), "inter" (NICs) or "local" (n = 1)


def collective_time(kind: str, n: int, nbytes: float, link: Link) -> float:
    """Seconds for one collective of `kind` over `n` ranks on `link` (S = full buffer)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "p2p":
        return link.latency + nbytes / link.bandwidth + link.fixed
    if kind not in _SCALE:
        raise PlanError(f"unknown collective {kind!r}; known: p2p, {', '.join(_SCALE)}")
    scale, offset = _SCALE[kind]
    beta = nbytes * scale * (1 + offset / n) / link.bandwidth
    return beta + link.latency * scale * (n + offset) + link.fixed


def strides(order: str, sizes: dict[str, int]) -> dict[str, int]:
    """Stride of each mesh dimension for a rank order such as "pp,dp,cp,tp" (tp innermost)."""
    names = [d.strip() for d in order.split(",") if d.strip()]
    if sorted(names) != sorted(DIMS):
        raise PlanError(f"rank order must name {', '.join(DIMS)} once each, got {order!r}")
    out, inner = {}, 1
    for name in reversed(names):
        out[name] = inner
        inner *= sizes.get(name, 1)
    return out


def group_link(cluster: Cluster, size: int, stride: int) -> Link:
    """The link a group of `size` ranks spaced `stride` apart runs on (see module doc)."""
    acc, g = cluster.accel, cluster.gpus_per_node
    intra = Link(acc.intra_gbs * 1e9 * acc.intra_eff, acc.intra_latency_us * 1e-6, level="intra")
    if size <= 1:
        return Link(intra.bandwidth, 0.0, level="local")
    if size * stride <= g:
        return intra
    per_node = max(1, min(size, g // stride)) if stride < g else 1
    inter_bw = acc.nic_gbs * 1e9 * acc.inter_eff * per_node
    return Link(min(inter_bw, intra.bandwidth), acc.inter_latency_us * 1e-6, level="inter")


def p2p_link(cluster: Cluster, size: int, stride: int) -> Link:
    """Pipeline neighbours `stride` ranks apart in a pipeline of `size` ranks.

    Inside one node they use the scale-up fabric; once the pipeline spans nodes some pair of
    neighbours crosses a node boundary, and one NIC bounds the pipeline (one latency serves
    every transfer in the replay, so the slowest pair's is taken).
    """
    acc = cluster.accel
    if size * stride <= cluster.gpus_per_node:
        return Link(acc.intra_gbs * 1e9 * acc.intra_eff, acc.intra_latency_us * 1e-6)
    return Link(acc.nic_gbs * 1e9 * acc.inter_eff, acc.inter_latency_us * 1e-6, level="inter")


def all_to_all_time(cluster: Cluster, n: int, nbytes: float, stride: int = 1) -> float:
    """All-to-all of a full buffer `nbytes` over `n` ranks (expert dispatch or combine).

    Within a node it is the ring form on the scale-up fabric. Across k nodes the (k-1)/k of
    the bytes bound for other nodes leave through each rank's own NIC (REFERENCE.md §4.4).
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = group_link(cluster, n, stride)
    if link.level != "inter":
        return collective_time("all_to_all", n, nbytes, link)
    acc = cluster.accel
    k = max(2, (n * stride) // cluster.gpus_per_node)
    nic = acc.nic_gbs * 1e9 * acc.inter_eff
    intra_part = collective_time(
        "all_to_all", n, nbytes / k, group_link(cluster, max(1, n // k), stride)
    )
    return intra_part + (k - 1) / k * nbytes / nic + (n - 1) * acc.inter_latency_us * 1e-6
