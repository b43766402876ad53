"""Collective communication times: the alpha-beta ring model, per topology level.

For n ranks and a full buffer of S bytes (nccl-tests `doc/PERFORMANCE.md`):

    all-reduce                                  2(n-1) alpha + 2 (n-1)/n * S / B
    all-gather, reduce-scatter, all-to-all      (n-1) alpha  +   (n-1)/n * S / B
    point-to-point                              alpha + S / B

B is the bus bandwidth on the group's slowest link (datasheet x efficiency), alpha one ring
step's latency; this is SimuMax's calibrated form. On CPU a blocking collective also waits
``collective_wait_us`` for peers that compute between calls (measured by `calibrate`).

The link follows the mesh's rank order (default ``pp,dp,cp,tp``): a group inside one node runs
on the scale-up fabric; one spanning nodes with r members per node gets r NICs' worth of
bandwidth (the node's NICs are shared by the groups of that dimension, as SimuMax divides
inter-node DP bandwidth by min(8, tp*cp)). Pipeline p2p across nodes gets one NIC.

Expert all-to-all across k nodes (`all_to_all_cost`): the (k-1)/k of the send buffer bound for
other nodes leaves through the rank's NIC while the on-node share crosses the scale-up fabric,
concurrently. With once-per-node dispatch (DeepSeek-V3 §3.2.2, DeepEP; ``dedup``) a token
limited to M nodes sends M (k-1)/k network copies instead of top_k (k-1)/k; a plain
variable-split all-to-all (hyperloom, Megatron) sends every copy.

Link tiers (`network.py`): a profile's ``intra_tier``/``inter_tier`` give each collective its
own bandwidth (``Tier.relative`` over the all-reduce's bus bandwidth), per-step latency and,
where measured, a latency once per call (``Tier.fixed_us``: B200's NVLink5 fit),
shrink a PCIe group's bandwidth as it grows (the ranks share the root complex), and slow a
collective across k nodes by ``1 + straggle log2 k``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hyperloom.planner.errors import PlanError
from hyperloom.planner.hardware import Cluster, HardwareProfile
from hyperloom.planner.network import Tier, get_tier

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
    # (kind, factor): a measured collective's bandwidth term over the ring model's from the
    # all-reduce (gloo's reduce-scatter and all-gather are no rings: 3.3-5.8x and 0.9-2.4x
    # measured on loopback)
    scale: tuple[tuple[str, float], ...] = ()
    # (kind, seconds) per ring step where a collective's latency differs from `latency`
    alphas: tuple[tuple[str, float], ...] = ()
    slow: float = 1.0  # the straggler factor of a group across nodes (`network.Tier`)
    # (kind, seconds) once per call on top of `fixed` (a tier's measured `fixed_us`)
    fixed_kind: tuple[tuple[str, float], ...] = ()

    def alpha(self, kind: str) -> float:
        """Seconds per ring step of a `kind` collective."""
        return next((a for k, a in self.alphas if k == kind), self.latency)

    def factor(self, kind: str) -> float:
        """`kind`'s factor on the bandwidth term."""
        return next((f for k, f in self.scale if k == kind), 1.0)

    def once(self, kind: str) -> float:
        """Seconds a `kind` collective pays once per call."""
        return self.fixed + next((f for k, f in self.fixed_kind if k == kind), 0.0)


def collective_time(kind: str, n: int, nbytes: float, link: Link) -> float:
    """Seconds for one collective of `kind` over `n` ranks on `link` (S = full buffer)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    alpha, factor, fixed = link.alpha(kind), link.factor(kind), link.once(kind)
    if kind == "p2p":
        return (alpha + nbytes * factor / link.bandwidth) * link.slow + fixed
    if kind not in _SCALE:
        raise PlanError(f"unknown collective {kind!r}; known: p2p, {', '.join(_SCALE)}")
    scale, offset = _SCALE[kind]
    beta = nbytes * scale * (1 + offset / n) / link.bandwidth * factor
    return (beta + alpha * scale * (n + offset)) * link.slow + fixed


def _tier_link(
    acc: HardwareProfile, bandwidth: float, level: str, n: int, nodes: int = 1, fixed: float = 0.0
) -> Link:
    """A link of `bandwidth` (the all-reduce's bus bandwidth) on the profile's tier of
    `level`, for a group of `n` ranks over `nodes` nodes: the tier's per-collective factors
    (times any calibrated `collective_scale`), latencies, group-size loss and stragglers."""
    inter = level == "inter"
    name = acc.inter_tier if inter else acc.intra_tier
    tier, scale, alphas = _tier_factors(name, acc.collective_scale)
    latency = (acc.inter_latency_us if inter else acc.intra_latency_us) * 1e-6
    measured = tier.at_size(n)
    if measured:  # the measured group size: its own bandwidth per kind and latencies
        ref = measured["all_reduce"][0]
        bw = bandwidth * ref
        scale = tuple((k, ref / rel) for k, (rel, _) in measured.items() if k != "all_reduce")
        alphas = tuple((k, us * 1e-6) for k, (_, us) in measured.items())
    else:
        bw = bandwidth * tier.group_factor(n)
    slow = tier.straggler(nodes) if inter else 1.0
    once = tuple((k, us * 1e-6) for k, us in tier.fixed_us)
    return Link(bw, latency, fixed, level, scale, alphas, slow, once)


@functools.lru_cache(maxsize=256)
def _tier_factors(name: str, measured: tuple[tuple[str, float], ...]):
    """(tier, per-kind factors on the bandwidth term, per-kind latencies) of a tier with a
    profile's measured `collective_scale` folded in."""
    tier: Tier = get_tier(name)
    found = dict(measured)
    factors = ((k, found.get(k, 1.0) / tier.efficiency(k)) for k in (*_SCALE, "p2p"))
    scale = tuple((k, f) for k, f in factors if f != 1.0)
    return tier, scale, tuple((k, a * 1e-6) for k, a in tier.latency_us)


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
    acc, g = cluster.profile, cluster.gpus_per_node
    bw = acc.intra_gbs * 1e9 * acc.intra_eff
    if size <= 1:
        return Link(bw, 0.0, level="local")
    if size * stride <= g:
        wait = acc.collective_wait_us * 1e-6
        if stride > 1 and get_tier(acc.intra_tier).shared:  # `stride` groups share the span
            return _tier_link(acc, bw / stride, "intra", size * stride, fixed=wait)
        return _tier_link(acc, bw, "intra", size, fixed=wait)
    per_node = max(1, min(size, g // stride)) if stride < g else 1
    inter_bw = acc.nic_gbs * 1e9 * acc.inter_eff * per_node
    return _tier_link(acc, min(inter_bw, bw), "inter", size, size // per_node)


def p2p_link(cluster: Cluster, size: int, stride: int) -> Link:
    """Pipeline neighbours `stride` ranks apart in a pipeline of `size` ranks.

    Inside one node they use the scale-up fabric; once the pipeline spans nodes some pair of
    neighbours crosses a node boundary, and one NIC bounds the pipeline (one latency serves
    every transfer in the replay, so the slowest pair's is taken).
    """
    acc = cluster.profile
    if size * stride <= cluster.gpus_per_node:
        wait = acc.collective_wait_us * 1e-6
        return _tier_link(acc, acc.intra_gbs * 1e9 * acc.intra_eff, "intra", 2, fixed=wait)
    return _tier_link(acc, acc.nic_gbs * 1e9 * acc.inter_eff, "inter", 2)


@dataclass(frozen=True)
class AllToAll:
    """An all-to-all over one expert-parallel group: ``latency + per_byte * S`` seconds for a
    per-rank send buffer of S bytes (see the module docstring)."""

    n: int = 1
    latency: float = 0.0
    per_byte: float = 0.0
    level: str = "local"
    nodes: int = 1

    def time(self, nbytes: float) -> float:
        if self.n <= 1 or nbytes <= 0:
            return 0.0
        return self.latency + self.per_byte * nbytes


def network_copies(top_k: int, nodes: int, node_limit: int | None = None) -> float:
    """Copies of one token that cross the network when the dispatcher sends one per remote
    destination node: ``M (k-1)/k`` with a node limit M, else the expected distinct remote
    nodes among `top_k` uniformly chosen experts on `nodes` nodes."""
    if nodes <= 1:
        return 0.0
    if node_limit is not None and node_limit < nodes:
        return min(node_limit, top_k) * (nodes - 1) / nodes
    return (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** top_k)


def node_limit(nodes: int, n_groups: int, topk_groups: int) -> int | None:
    """Nodes a token can reach under group-limited routing when the expert groups line up with
    the nodes of the expert-parallel group (experts are placed in order, E/ep per rank), or
    None: one group per node (DeepSeek-V3: 8 groups on 8 nodes, 4 kept) limits a token to
    `topk_groups` nodes; g groups per node or a group over g nodes scale that."""
    if n_groups <= 1 or topk_groups >= n_groups:
        return None
    if n_groups % nodes == 0:  # whole groups on each node: the kept groups' nodes at most
        return min(nodes, topk_groups)
    if nodes % n_groups == 0:  # each group spans nodes / n_groups nodes
        return min(nodes, topk_groups * nodes // n_groups)
    return None


def all_to_all_cost(
    cluster: Cluster,
    n: int,
    stride: int = 1,
    top_k: int = 1,
    groups: tuple[int, int] = (1, 1),
    dedup: bool = False,
) -> AllToAll:
    """The all-to-all of an expert-parallel group of `n` ranks spaced `stride` apart; with
    `dedup`, a token's `top_k` copies cross the network once per destination node, and
    group-limited routing (`groups` = (n_groups, topk_groups)) bounds those nodes (module
    docstring)."""
    if n <= 1:
        return AllToAll()
    link = group_link(cluster, n, stride)
    factor, alpha = link.factor("all_to_all"), link.alpha("all_to_all")
    if link.level != "inter":
        beta = (n - 1) / n / link.bandwidth * factor
        return AllToAll(n, (n - 1) * alpha + link.once("all_to_all"), beta, link.level)
    acc, g = cluster.profile, cluster.gpus_per_node
    k = max(2, (n * stride) // g)  # nodes the group spans
    r = max(1, n // k)  # members per node
    nic = acc.nic_gbs * 1e9 * acc.inter_eff * get_tier(acc.inter_tier).efficiency("all_to_all")
    fabric = acc.intra_gbs * 1e9 * acc.intra_eff * get_tier(acc.intra_tier).efficiency("all_to_all")
    off_node = (k - 1) / k
    if dedup:
        limit = node_limit(k, *groups)
        off_node *= network_copies(top_k, k, limit) / (top_k * (k - 1) / k)
        on_node = (r - 1) / r  # forwarded inside the destination node: every copy
    else:
        on_node = (r - 1) / r / k
    per_byte = max(off_node / nic, on_node / fabric) * link.slow
    return AllToAll(n, (n - 1) * alpha * link.slow, per_byte, "inter", k)


def all_to_all_time(cluster: Cluster, n: int, nbytes: float, stride: int = 1) -> float:
    """A plain all-to-all of a per-rank send buffer of `nbytes` over `n` ranks."""
    return all_to_all_cost(cluster, n, stride).time(nbytes)


@dataclass(frozen=True)
class Links:
    tp: Link
    cp: Link
    cp_p2p: Link  # ring attention's neighbour exchange (one NIC once the ring spans nodes)
    dp: Link  # the gradient group: data x context parallel (`Strategy.dcp`)
    pp: Link
    ep: Link | None = None  # the expert-parallel group (all-gather dispatcher)
    etp: Link | None = None  # the expert-tensor-parallel group when etp < tp (else `tp`)
    etp_rep: Link | None = None  # the tp / etp ranks of a tp group holding the same slices
    edp: Link | None = None  # the expert-data-parallel group (expert gradients)
    a2a: AllToAll = AllToAll()  # the expert-parallel all-to-all
    cp_a2a: AllToAll = AllToAll()  # Ulysses' all-to-all over the cp group
    shard: Link | None = None  # HSDP: one replica group (FSDP2's shard group); else `dp`
    replicate: Link | None = None  # HSDP: the ranks holding the same shards
