"""Predict one strategy: costs laid onto the schedule IR, simulated, turned into a `Plan`.

For a model, cluster, strategy and runtime: cost one layer (`costs.layer_phase`), cut the
model into chunks (`costs.assign_layers`), give every stage its chunk's F/B/W seconds, build
the schedule the executor runs and replay it with the activation transfer as p2p latency
(`pipeline.simulate`), so bubbles and exposed p2p come from the replay. Each rank finishes at
its last compute event plus shared-gradient all-reduces, exposed dp sync and its optimizer
step; memory uses the replay's peak in-flight counts. Overlapped FB pairs (DualPipe's, and
those `parallel.ep_overlap` forms in interleaved and ZB-V steady states) hide a share of the
expert all-to-all time (`Runtime.ep_pair_hidden`, with `Strategy.ep_overlap`). MFU is model
FLOPs per second (Megatron/PaLM convention, recompute not counted) over the BF16 dense peak.

`fast=True` (the search's) replays at two micro-batch counts past the steady state and
extrapolates each rank's finish linearly to m, without p2p actions; tests hold it to the
exact replay within 1%.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from hyperloom.pipeline import Costs, SimResult, StageCost, add_communication, build_schedule
from hyperloom.pipeline import simulate as replay_schedule
from hyperloom.pipeline.ir import (
    ActionKind,
    Schedule,
    ScheduleError,
    standard_placement,
    v_placement,
)
from hyperloom.pipeline.schedules import pair_forward_backward
from hyperloom.pipeline.validate import replay
from hyperloom.planner import launches
from hyperloom.planner.collectives import collective_time
from hyperloom.planner.costs import (
    Links,
    Phase,
    assign_layers,
    chunk_expert_params,
    chunk_frozen_params,
    dp_sync,
    embedding_phase,
    head_phase,
    layer_phase,
    links_for,
    local_params,
    optimizer_time,
    shared_grad_groups,
)
from hyperloom.planner.errors import PlanError
from hyperloom.planner.fsdp import root_gather_time
from hyperloom.planner.hardware import GIB, Cluster, HardwareProfile, roofline
from hyperloom.planner.memory import LayerMemory, Memory, cp_buffer, dispatch_buffer, rank_memory
from hyperloom.planner.model import ModelSpec, build_layer
from hyperloom.planner.strategy import RUNTIMES, Runtime, Strategy, check
from hyperloom.planner.vision import TowerMemory, tower_memory, tower_phase

DEFAULT_MARGIN_GIB = 6.0
_SATURATION = {"interleaved": 2, "zb-v": 3, "dualpipev": 3, "dualpipe": 3, "1f1b": 2, "zb-h1": 2}


@dataclass
class Plan:
    """Predicted step time, throughput and per-rank memory of one strategy."""

    model: ModelSpec
    strategy: Strategy
    cluster: Cluster
    runtime: Runtime
    seq: int
    step_time: float
    bubble_fraction: float  # idle share of all pipeline ranks' time in the replay
    mfu: float
    memory: list[Memory]  # per pipeline rank
    capacity: float  # usable bytes per device (HBM minus the margin)
    breakdown: dict[str, float]  # seconds of the step on the rank that finishes last
    simulated_microbatches: int
    sim: SimResult | None = field(default=None, repr=False)
    rank_breakdown: list[dict[str, float]] = field(default_factory=list, repr=False)
    # the same strategy at the roofline (`with_roofline`): the bound no run can beat
    roofline_step_time: float = 0.0
    roofline_mfu: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.strategy.global_batch * self.seq / self.step_time

    @property
    def tflops_per_gpu(self) -> float:
        return self.mfu * self.cluster.profile.bf16_tflops

    @property
    def peak_memory(self) -> float:
        return max(m.peak for m in self.memory)

    @property
    def reserved_memory(self) -> float:
        return max(m.reserved for m in self.memory)

    @property
    def fits(self) -> bool:
        return self.reserved_memory <= self.capacity

    def to_dict(self) -> dict:
        return {
            "model": self.model.name,
            "strategy": self.strategy.to_dict(),
            "label": self.strategy.label(),
            "accelerator": self.cluster.profile.name,
            "gpus": self.cluster.gpus,
            "runtime": self.runtime.name,
            "seq": self.seq,
            "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_gib": self.peak_memory / GIB,
            "reserved_memory_gib": self.reserved_memory / GIB,
            "capacity_gib": self.capacity / GIB,
            "fits": self.fits,
            "breakdown_s": self.breakdown,
            "memory_per_rank_gib": [
                {k: v / GIB for k, v in m.to_dict().items()} for m in self.memory
            ],
            "simulated_microbatches": self.simulated_microbatches,
            **(
                {"roofline_step_time_s": self.roofline_step_time, "roofline_mfu": self.roofline_mfu}
                if self.roofline_step_time
                else {}
            ),
        }


@functools.lru_cache(maxsize=1024)
def _schedule(kind: str, pp: int, m: int, vpp: int, comm: bool, paired: bool = False) -> Schedule:
    """The schedule the executor runs; `paired`: with `parallel.ep_overlap`'s F&B pairs."""
    sched = build_schedule(kind, pp, m, vpp)
    if paired:
        sched = pair_forward_backward(sched)
    return add_communication(sched) if comm and pp > 1 else sched


@functools.lru_cache(maxsize=1024)
def _structure(kind: str, pp: int, m: int, vpp: int):
    """(stage -> chunk, peak in-flight, peak W-pending) of a schedule; costs do not matter.

    A stage's model chunk is its position along its pipe (DualPipe's copy of chunk k is
    chunk k again)."""
    sched = _schedule(kind, pp, m, vpp, False)
    chunk_of = {st: j for pipe in sched.pipes for j, st in enumerate(pipe.stages)}
    rep = replay(sched)
    return chunk_of, rep.peak_in_flight, rep.peak_w_pending


@functools.lru_cache(maxsize=1024)
def _rank_chunks(kind: str, pp: int, vpp: int) -> tuple[tuple[int, ...], ...]:
    """Model chunks each rank holds, from the IR's placement rules (no schedule built)."""
    if kind == "dualpipe":
        return tuple(tuple(sorted({r, pp - 1 - r})) for r in range(pp))
    place = v_placement(pp) if kind in ("zb-v", "dualpipev") else standard_placement(pp, vpp)
    return tuple(tuple(c for c, rank in enumerate(place) if rank == r) for r in range(pp))


def _sim_points(s: Strategy) -> tuple[int, int] | None:
    """(m1, m2) for the extrapolated replay, or None when m is small enough to replay."""
    sat = _SATURATION.get(s.schedule)
    if sat is None or s.pp == 1:
        return None
    m1 = sat * s.pp
    m2 = m1 + s.pp
    return (m1, m2) if s.microbatches > m2 else None


def effective_profile(cluster: Cluster, rt: Runtime) -> HardwareProfile:
    """The accelerator as a training step uses it: compute and memory rates times the
    profile's ``step_eff`` (what a step sustains of its kernels' isolated speed) and
    `Runtime.efficiency` (a further factor a user may give; 1 by default)."""
    return _scaled_profile(cluster.profile, rt.efficiency)


@functools.lru_cache(maxsize=64)
def _scaled_profile(acc: HardwareProfile, efficiency: float) -> HardwareProfile:
    """`effective_profile`, one object per (profile, efficiency): the layer-cost caches
    (`costs.gemm_passes`) find it again."""
    e = efficiency * acc.step_eff
    if e == 1.0:
        return acc
    return dataclasses.replace(acc, bf16_tflops=acc.bf16_tflops * e, hbm_gbs=acc.hbm_gbs * e)


@functools.lru_cache(maxsize=4096)
def _layer(spec: ModelSpec, cluster: Cluster, rt: Runtime, seq: int, key: Strategy):
    """Layer costs and memory figures, embedding and head Phases and links; `key` is the
    strategy with the fields that do not change a layer (schedule, vpp, micro-batch count)
    reset, so one entry serves every schedule of a layout. A vlm's encoder and projector
    (`vision.tower_phase`) join the embedding on the first chunk; a frozen decoder has no
    weight-gradient pass (and no ZeRO-3 gathers: frozen parameters stay whole)."""
    links = links_for(cluster, key, spec, rt.a2a_node_dedup)
    acc = effective_profile(cluster, rt)
    # MLA's ring passes the compressed latent unless wkv_b runs in FP8 (models.deepseek.mla)
    latent_ring = key.cp > 1 and key.cp_comm == "ring" and not key.fp8
    layer = build_layer(
        spec, key.mbs, seq, key.tp, key.cp, key.sp, rt.sharded_save, key.ep, rt.autocast_per_op,
        rt.act_width, latent_ring, key.etp,
    )  # fmt: skip
    wgrad = not spec.frozen("decoder")
    dec = key if wgrad else dataclasses.replace(key, zero=0)
    one = layer_phase(layer, spec, dec, acc, links, rt, wgrad=wgrad)
    one = one + launches.layer_phase(spec, acc, wgrad)  # fixed per-call costs (B200)
    emb = embedding_phase(spec, key, seq, acc, links, rt, wgrad=wgrad)
    head = head_phase(spec, key, seq, acc, links, rt, wgrad=wgrad)
    head = head + launches.head_phase(acc, wgrad)
    if wgrad:  # FSDP2's root module: gathered at each forward (frozen: kept whole)
        first, last = (root_gather_time(spec, key, rt, links, end) for end in (False, True))
        emb = emb + Phase(f=first, dp_comm=first)  # exposed: nothing runs before it
        head = head + Phase(f=last, dp_comm=last)
    if spec.vision:
        emb = emb + tower_phase(spec, key, seq, acc, links, rt)
    if spec.mtp_depth:  # each MTP module: one (mean) block and its own head, last chunk
        mtp_one, mtp_head = one, head
        if key.cp > 1:  # every cp rank runs them on whole sequences (models.deepseek)
            whole = dataclasses.replace(key, cp=1)
            mtp_layer = build_layer(
                spec, key.mbs, seq, key.tp, 1, key.sp, rt.sharded_save, key.ep,
                rt.autocast_per_op, rt.act_width, etp=key.etp,
            )  # fmt: skip
            mtp_one = layer_phase(mtp_layer, spec, whole, acc, links, rt)
            mtp_head = head_phase(spec, whole, seq, acc, links, rt)
        head = head + (mtp_head + mtp_one).scaled(spec.mtp_depth)
    fp8_saved = key.fp8 and rt.fp8_saved_inputs
    lm = LayerMemory.of(
        layer,
        key.recompute,
        fp8_saved,
        dispatch_buffer(layer, spec, key),
        cp_buffer(layer, key, rt.act_width),
    )
    tower = tower_memory(spec, key, rt, fp8_saved) if spec.vision else None
    return lm, one, emb, head, links, tower


@functools.lru_cache(maxsize=4096)
def _chunks(spec: ModelSpec, tp: int, ep: int, rank_chunks, etp: int = 0):
    """(layers, local params, local routed-expert params, frozen params) per model chunk."""
    layers = tuple(assign_layers(spec.n_layers, rank_chunks))
    params, experts = local_params(spec, tp, ep, list(layers), etp)
    frozen = chunk_frozen_params(spec, tp, params)
    if spec.frozen("decoder"):  # the routed experts are frozen with it: no expert states
        experts = [0.0] * len(experts)
    return layers, tuple(params), tuple(experts), tuple(frozen)


def _paired_share(res: SimResult, fb: float) -> list[float]:
    """Per rank, the share of its compute (pairs counted at their unoverlapped length) that
    ran inside overlapped F&B pairs in replay `res`: DualPipe pairs most of it, a paired
    interleaved steady state less."""
    out = []
    for events in res.events:
        pairs = sum(e.end - e.start for e in events if e.action.kind is ActionKind.FB) / fb
        rest = sum(
            e.end - e.start
            for e in events
            if e.action.kind.is_compute and e.action.kind is not ActionKind.FB
        )
        out.append(pairs / (pairs + rest) if pairs + rest else 0.0)
    return out


def fb_overlap(work: Phase, rt: Runtime) -> float:
    """`pipeline.Costs.fb_overlap` for overlapped pairs (`Strategy.ep_overlap`): the share of
    a forward-and-backward pair left after ``ep_pair_hidden`` of the expert-parallel
    communication in `work` hides behind the other micro-batch's work (DeepSeek-V3
    §3.2.1)."""
    total = work.total
    if not rt.ep_pair_hidden or not work.ep_comm or not total:
        return 1.0
    hidden = rt.ep_pair_hidden * min(work.ep_comm, total - work.ep_comm)
    return 1.0 - hidden / total


@dataclass(frozen=True, eq=False)
class Prepared:
    """Everything about a strategy that does not need the timed replay. Per-chunk costs are
    numpy arrays (seconds per micro-batch) so that the search's bounds are a few vector ops."""

    strategy: Strategy
    layers: tuple[int, ...]  # per model chunk
    params: tuple[float, ...]  # per model chunk, on one rank (tp split, 1/ep of the experts)
    experts: tuple[float, ...]  # the local routed experts among `params` (0 at ep = 1)
    one: Phase  # one layer
    ends: tuple[Phase, Phase]  # embedding (first chunk), head (last chunk)
    f: np.ndarray
    b: np.ndarray
    w: np.ndarray
    layer_memory: LayerMemory
    links: Links
    rank_chunks: tuple[tuple[int, ...], ...]
    p2p: float  # seconds of one activation transfer between pipeline ranks
    fb_overlap: float = 1.0  # DualPipe's F&B pairs (`fb_overlap`)
    frozen: tuple[float, ...] = ()  # per model chunk, the frozen part of `params` (vlm)
    tower: TowerMemory | None = None  # a vlm's encoder and projector, first chunk
    # per model chunk, its layers' Phase where they are not `layers` x `one` (`_chunk_layers`)
    chunk_layers: tuple[Phase, ...] = ()

    @functools.cached_property
    def trainable(self) -> tuple[float, ...]:
        """Parameters per model chunk on one rank that have gradients and optimizer state."""
        if not self.frozen:
            return self.params
        return tuple(p - f for p, f in zip(self.params, self.frozen, strict=True))

    @functools.cached_property
    def phases(self) -> list[Phase]:
        out = list(self.chunk_layers) or [self.one.scaled(n) for n in self.layers]
        out[0] = out[0] + self.ends[0]
        out[-1] = out[-1] + self.ends[1]
        return out

    def rank_phase(self, rank: int) -> Phase:
        out = Phase()
        for c in self.rank_chunks[rank]:
            out = out + self.phases[c]
        return out

    def rank_sum(self, per_chunk: np.ndarray) -> np.ndarray:
        s = self.strategy
        if s.schedule == "dualpipe":  # rank r holds chunk r and a copy of chunk pp-1-r
            return per_chunk + per_chunk[::-1]
        return np.bincount(_placement(s.schedule, s.pp, s.vpp), per_chunk, minlength=s.pp)

    def structure(self):
        """(stage -> chunk, peak in-flight, peak W-pending) from the schedule replay, at a
        micro-batch count past saturation (the counts no longer grow)."""
        s = self.strategy
        points = _sim_points(s)
        try:
            return _structure(s.schedule, s.pp, points[0] if points else s.microbatches, s.vpp)
        except ScheduleError as exc:
            raise PlanError(f"{s.label()}: {exc}") from None


@functools.lru_cache(maxsize=1024)
def _placement(kind: str, pp: int, vpp: int) -> np.ndarray:
    """Rank of each model chunk (standard or V placement)."""
    if kind in ("zb-v", "dualpipev"):
        return np.array(v_placement(pp))
    return np.array(standard_placement(pp, vpp))


def prepare(spec: ModelSpec, cluster: Cluster, s: Strategy, seq: int, rt: Runtime) -> Prepared:
    """Costs per chunk and chunk placement (no schedule replay)."""
    key = dataclasses.replace(s, schedule="1f1b", vpp=1, microbatches=1)
    lm, one, emb, head, links, tower = _layer(spec, cluster, rt, seq, key)
    rank_chunks = _rank_chunks(s.schedule, s.pp, s.vpp)
    layers, params, experts, frozen = _chunks(spec, s.tp, s.ep, rank_chunks, s.etp)
    parts = _chunk_layers(spec, cluster, rt, seq, key, layers)
    if parts:
        f, b, w = (np.array([getattr(p, k) for p in parts]) for k in "fbw")
    else:
        n = np.asarray(layers, dtype=float)
        f, b, w = one.f * n, one.b * n, one.w * n
    for i, ph in ((0, emb), (-1, head)):
        f[i] += ph.f
        b[i] += ph.b
        w[i] += ph.w
    act = rt.p2p_bytes * s.mbs * seq / s.cp * spec.dim / (s.tp if s.sp and s.tp > 1 else 1)
    prep = Prepared(
        strategy=s,
        layers=layers,
        params=params,
        experts=experts,
        one=one,
        ends=(emb, head),
        f=f,
        b=b,
        w=w,
        layer_memory=lm,
        links=links,
        rank_chunks=rank_chunks,
        p2p=collective_time("p2p", 2, act, links.pp),
        frozen=frozen if any(frozen) else (),
        tower=tower,
        chunk_layers=parts,
    )
    if s.ep_overlap and rt.ep_pair_hidden and one.ep_comm:
        # One factor serves every pair (`Costs` has one): the busiest rank's, so the rank
        # that sets the step is exact and the others hide slightly less than they could.
        busiest = max((prep.rank_phase(r) for r in range(s.pp)), key=lambda ph: ph.total)
        return dataclasses.replace(prep, fb_overlap=fb_overlap(busiest, rt))
    return prep


def _chunk_layers(spec, cluster, rt, seq: int, key: Strategy, layers) -> tuple[Phase, ...]:
    """Each chunk's layers as they are when a DeepSeek model's dense layers lead (its first
    `n_dense_layers`, as Megatron-Core's `moe_layer_freq` places them): the first chunks run
    dense layers, the later ones MoE layers, each costed as itself. Empty where every chunk's
    layers are the mean layer's multiple (one chunk, or no mix of dense and MoE layers)."""
    nd, total = spec.n_dense_layers, spec.n_layers
    if not spec.mla or len(layers) < 2 or not 0 < nd < total:
        return ()
    dense = _layer(spec.with_config(n_dense_layers=total), cluster, rt, seq, key)[1]
    moe = _layer(spec.with_config(n_dense_layers=0), cluster, rt, seq, key)[1]
    out, start = [], 0
    for n in layers:
        d = max(0, min(start + n, nd) - start)
        out.append(dense.scaled(d) + moe.scaled(n - d))
        start += n
    return tuple(out)


def memory_per_rank(
    spec: ModelSpec,
    s: Strategy,
    seq: int,
    rt: Runtime,
    prep: Prepared,
    ranks: tuple[int, ...] | None = None,
    host: tuple[float, float, float] = (1.0, 0.0, 0.0),
) -> list[Memory]:
    """Memory of each rank (or of `ranks` only: the search checks 0, 1 and the last);
    `host` from the accelerator profile (`HardwareProfile.host_memory`)."""
    _, in_flight, w_pending = prep.structure()
    if s.pp == 1 and s.ep_overlap and s.microbatches > 1:  # a pair holds two micro-batches
        in_flight = (max(2, in_flight[0]),)
    return [
        rank_memory(
            spec,
            s,
            rt,
            seq,
            prep.layer_memory,
            prep.rank_chunks[r],
            list(prep.layers),
            list(prep.params),
            in_flight[r],
            w_pending[r],
            list(prep.experts),
            host,
            list(prep.frozen) or None,
            prep.tower,
        )
        for r in (range(s.pp) if ranks is None else ranks)
    ]


def chunk_passes(s: Strategy) -> float:
    """Micro-batches that pass through each of a rank's chunks per step: all of them, except
    under DualPipe, where half enter from each end, so each of a rank's two chunks (its own
    and the copy) sees m/2."""
    return s.microbatches / 2 if s.schedule == "dualpipe" else s.microbatches


def accumulation_pairs_hidden(s: Strategy, prep: Prepared) -> float:
    """Seconds `parallel.ep_overlap` hides at pp = 1 (`parallel.overlap_accum`): gradient
    accumulation runs F0, then m - 1 pairs (F_i, B_{i-1}), then B_{m-1}, and each pair hides
    ``1 - fb_overlap`` of one micro-batch's work (`fb_overlap`: ``Runtime.ep_pair_hidden`` of
    the all-to-alls of the two halves). 0 elsewhere (the pipeline's pairs are in its IR)."""
    if s.pp > 1 or not s.ep_overlap or prep.fb_overlap == 1.0:
        return 0.0
    return (s.microbatches - 1) * (1.0 - prep.fb_overlap) * prep.rank_phase(0).total


def lower_bound(s: Strategy, prep: Prepared, cluster: Cluster, rt: Runtime) -> float:
    """A step time no replay of the schedule can beat.

    Rank r cannot start before micro-batch 0 has gone forward through every chunk before its
    first one, must then do all its work, and after its last input-gradient backward the
    gradient still has to travel back through those chunks:
    ``pre_r + max(busy_r, m*(F_r + B_r) + post_r)`` (B of a full-backward schedule includes
    W), plus its optimizer step. DualPipe's two directions get the plain ``busy_r`` bound.
    """
    split = s.schedule in ("zb-h1", "zb-v", "dualpipev")
    m = s.microbatches
    back = prep.b if split else prep.b + prep.w
    busy = chunk_passes(s) * prep.rank_sum(prep.f + prep.b + prep.w)
    if prep.fb_overlap != 1.0:  # an F&B pair is no shorter than fb_overlap x its parts
        busy = busy * prep.fb_overlap
    bound = busy
    if s.schedule != "dualpipe":
        first = np.arange(s.pp)  # rank r's first chunk is chunk r (standard and V)
        pre = np.concatenate(([0.0], np.cumsum(prep.f)))[first] + first * prep.p2p
        post = np.concatenate(([0.0], np.cumsum(back)))[first] + first * prep.p2p
        own = m * prep.rank_sum(prep.f + back)
        if prep.fb_overlap != 1.0:
            own = own * prep.fb_overlap
        bound = pre + np.maximum(busy, own + post)
    acc = effective_profile(cluster, rt)
    per_param = optimizer_time(1.0, s, acc, rt)
    opt = per_param * prep.rank_sum(np.asarray(prep.trainable))
    if s.ep > 1:  # the local experts' optimizer shard is over the expert-data-parallel group
        per_expert = optimizer_time(1.0, s, acc, rt, expert=1.0) - per_param
        opt = opt + per_expert * prep.rank_sum(np.asarray(prep.experts))
    return float(np.max(bound + opt))


def predict(
    spec: ModelSpec,
    cluster: Cluster,
    s: Strategy,
    seq: int,
    runtime: Runtime | str = "hyperloom",
    margin_gib: float = DEFAULT_MARGIN_GIB,
    fast: bool = False,
    prep: Prepared | None = None,
) -> Plan:
    """Simulate strategy `s` (see module docstring); raises PlanError if it cannot run."""
    rt = RUNTIMES[runtime] if isinstance(runtime, str) else runtime
    why = check(s, spec, seq, cluster.gpus)
    if s.fp8 and not cluster.profile.supports_fp8:
        why = f"fp8 requested, but {cluster.profile.name} has no FP8 tensor cores"
    if why:
        raise PlanError(f"{s.label()}: {why}")
    prep = prep or prepare(spec, cluster, s, seq, rt)
    chunk_of = prep.structure()[0]
    points = _sim_points(s) if fast else None
    m_runs = points or (s.microbatches,)
    results = []
    try:
        for m in m_runs:
            paired = s.ep_overlap and prep.fb_overlap != 1.0 and s.pp > 1
            sched = _schedule(s.schedule, s.pp, m, s.vpp, not fast, paired)
            per_stage = {
                st: StageCost(float(prep.f[c]), float(prep.b[c]), float(prep.w[c]))
                for st, c in chunk_of.items()
            }
            costs = Costs(comm=prep.p2p, per_stage=per_stage, fb_overlap=prep.fb_overlap)
            results.append(replay_schedule(sched, costs))
    except ScheduleError as exc:
        raise PlanError(f"{s.label()}: {exc}") from None

    def last_end(r: SimResult, rank: int) -> float:
        return max((e.end for e in r.events[rank] if e.action.kind.is_compute), default=0.0)

    m = s.microbatches
    ends = []
    for rank in range(s.pp):
        if points:
            (m1, m2), (r1, r2) = points, results
            e1, e2 = last_end(r1, rank), last_end(r2, rank)
            ends.append(e1 + (m - m1) * (e2 - e1) / (m2 - m1))
        else:
            ends.append(last_end(results[0], rank))

    accum_hidden = accumulation_pairs_hidden(s, prep)
    ends[0] -= accum_hidden

    # the all-reduces of shared gradients over pipeline subgroups wait for every member
    shared_end, shared = list(ends), [0.0] * s.pp
    for ranks, p in shared_grad_groups(spec, s.tp, prep.rank_chunks, prep.trainable):
        t = collective_time("all_reduce", len(ranks), p * rt.grad_bytes, prep.links.pp)
        start = max(shared_end[r] for r in ranks)
        for r in ranks:
            shared_end[r], shared[r] = start + t, shared[r] + t

    acc = effective_profile(cluster, rt)
    finish, parts, busy_all = [], [], 0.0
    m = chunk_passes(s)
    paired = _paired_share(results[0], prep.fb_overlap)
    # sp with etp < tp: each tp rank's own tokens went through its slices, which the tp / etp
    # ranks holding them sum after the backward (`costs.dp_sync`)
    routed = [0.0] * len(prep.layers)
    if s.sp and s.etp_size < s.tp and spec.n_routed_experts:
        routed = [p / s.ep for p in chunk_expert_params(spec, s.etp_size, list(prep.layers))]
    for rank in range(s.pp):
        p_rank = sum(prep.trainable[c] for c in prep.rank_chunks[rank])
        e_rank = sum(prep.experts[c] for c in prep.rank_chunks[rank])
        r_rank = sum(routed[c] for c in prep.rank_chunks[rank])
        per_mb = prep.rank_phase(rank)
        dp_total, dp_exposed = dp_sync(
            p_rank, per_mb.f, per_mb.b + per_mb.w, s, prep.links, rt, e_rank, r_rank
        )
        opt = optimizer_time(p_rank, s, acc, rt, e_rank)
        finish.append(shared_end[rank] + dp_exposed + opt)
        busy = m * per_mb.total
        hidden = busy * paired[rank] * (1.0 - prep.fb_overlap) + accum_hidden
        busy_all += busy - hidden
        parts.append(
            {
                "compute": m * per_mb.compute,
                "recompute": m * per_mb.recompute,
                "tp_comm": m * per_mb.tp_comm,
                "cp_comm": m * per_mb.cp_comm,
                "zero3_gather": m * per_mb.dp_comm,
                "pipeline_bubble": max(0.0, ends[rank] - busy + hidden),
                "dp_sync_exposed": dp_exposed,
                "shared_grad_sync": shared[rank],
                "optimizer": opt,
                "dp_sync_total": dp_total,
            }
        )
        if s.ep > 1 or per_mb.ep_comm:  # expert-parallel (and expert-tensor-parallel)
            parts[-1]["ep_comm"] = m * per_mb.ep_comm
            if hidden:
                parts[-1]["ep_hidden_by_fb_pairs"] = -hidden
    step = max(finish)
    makespan = max(ends)
    flops = spec.model_flops_per_token(seq) * s.global_batch * seq
    return Plan(
        model=spec,
        strategy=s,
        cluster=cluster,
        runtime=rt,
        seq=seq,
        step_time=step,
        bubble_fraction=1.0 - busy_all / (s.pp * makespan) if makespan else 0.0,
        mfu=flops / (step * cluster.gpus * cluster.profile.bf16_tflops * 1e12),
        memory=memory_per_rank(spec, s, seq, rt, prep, None, cluster.profile.host_memory),
        capacity=(cluster.profile.hbm_gib - margin_gib) * GIB,
        breakdown=parts[finish.index(step)],
        simulated_microbatches=m_runs[0],
        sim=None if points else results[0],
        rank_breakdown=parts,
    )


def with_roofline(plan: Plan, fast: bool = True) -> Plan:
    """`plan` with its roofline bound filled in: the same strategy on `hardware.roofline` of its
    profile (datasheet peaks, full HBM and link bandwidth, no latency or host overhead) at
    efficiency 1 -- the step no run can beat. Reports show it beside the realistic step."""
    cluster = dataclasses.replace(plan.cluster, profile=roofline(plan.cluster.profile))
    rt = dataclasses.replace(plan.runtime, efficiency=1.0)
    bound = predict(plan.model, cluster, plan.strategy, plan.seq, rt, fast=fast)
    plan.roofline_step_time, plan.roofline_mfu = bound.step_time, bound.mfu
    return plan
