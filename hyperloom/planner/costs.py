"""Seconds: per-layer and per-stage F/B/W times, data-parallel sync and the optimizer step.

Compute is a roofline per op (`hardware.HardwareProfile`): GEMMs at the BF16 (or FP8) peak
times their shape's efficiency, or at memory speed if bytes dominate; the attention core at
flash efficiency on its causal FLOPs (the 2022 unfused form as two GEMMs plus softmax
traffic); elementwise kernels as bytes over HBM. The backward follows Zero Bubble's split
(arXiv 2401.10241): B = dgrad GEMMs, 2.5x the flash forward and twice the elementwise
traffic; W = wgrad GEMMs; BW = both. Recomputation adds what it re-runs to B.

Communication per layer and micro-batch (`collectives.py`), each exposed as
comm - eta * min(comm, compute of the same pass) with the runtime's overlap eta:

- TP: two all-reduces each way, or with SP two all-gathers plus two reduce-scatters (and two
  re-gathers for wgrad when inputs are saved sharded);
- CP (`context_comm`), ring: cp steps of 1/cp of the rank's attention each; before every
  step but the last the next K/V block goes to the next rank (p2p, activation dtype), and
  each exchange exposes only what exceeds its step's compute; backward also passes the FP32
  dK/dV accumulators round (cp exchanges, each behind the next step, the last exposed).
  Ulysses (alltoall): q, k, v and the output all-to-all'd each way, nothing hidden;
- ZeRO-3 (`fsdp.py`): each layer's gathers forward and backward, the root module's once per
  micro-batch, FSDP2's copies on the compute stream;
- EP: dispatch and combine each way, tokens x top_k x dim elements times `moe_imbalance`
  (the busiest receiver sets the pace), as an all-to-all or the all-gather dispatcher's
  gather/reduce-scatter pair; optionally FP8 dispatch; hidden only inside overlapped FB
  pairs (`ep_pair_hidden`, with `Strategy.ep_overlap`);
- expert tensor parallelism (`Strategy.etp`, e ranks split each routed expert): with sp (or
  etp unset, Megatron's layout) the etp group gathers the dispatched rows and reduce-scatters
  the outputs each way at ep > 1 (at ep = 1 the FFN block's sp collectives carry them);
  without sp an all-reduce over e of the routed outputs and their input gradient, at any ep.

Per step (`dp_sync`): the dp gradient reduction per ZeRO mode (HSDP: reduce-scatter over a
replica group, then the shard's all-reduce across groups) minus what the runtime overlaps (the
last bucket always exposed), expert gradients over their own group, with sp and etp < tp the
routed experts' gradients summed over the tp / etp ranks holding the same slices (exposed),
then Adam as memory traffic over the rank's state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from hyperloom.planner.collectives import (
    Links,
    all_to_all_cost,
    collective_time,
    group_link,
    p2p_link,
    strides,
)
from hyperloom.planner.fsdp import zero3_gather_groups as zero3_gather_groups  # re-exported
from hyperloom.planner.fsdp import zero3_layer_traffic
from hyperloom.planner.hardware import Cluster, HardwareProfile
from hyperloom.planner.memory import ce_chunk_tokens
from hyperloom.planner.model import Layer, ModelSpec, parse_recompute
from hyperloom.planner.strategy import Runtime, Strategy


def expert_strides(s: Strategy, st: dict[str, int]) -> tuple[int, int]:
    """(ep stride, edp stride): ep folds over dp x cp (`parallel/mesh.py`), so an expert
    group is `ep` consecutive ranks of that folded dimension, innermost first, and the
    expert-data-parallel group steps over whole expert groups."""
    inner = sorted(st[d] for d in ("dp", "cp") if getattr(s, d) > 1)
    stride = inner[0] if inner else 1
    return stride, stride * s.ep


def links_for(cluster: Cluster, s: Strategy, spec: ModelSpec | None = None, dedup=False) -> Links:
    st = strides(s.order, {"pp": s.pp, "dp": s.dp, "cp": s.cp, "tp": s.tp})
    links = Links(
        tp=group_link(cluster, s.tp, st["tp"]),
        cp=group_link(cluster, s.cp, st["cp"]),
        cp_p2p=p2p_link(cluster, s.cp, st["cp"]),
        dp=group_link(cluster, s.dcp, expert_strides(s, st)[0]),  # gradients: dp x cp
        pp=p2p_link(cluster, s.pp, st["pp"]),
        cp_a2a=all_to_all_cost(cluster, s.cp, st["cp"]),
    )
    if s.dp_replicate > 1:  # replica groups: consecutive runs of the folded dp x cp line
        inner, n = expert_strides(s, st)[0], s.fsdp_shard
        links = dataclasses.replace(
            links,
            shard=group_link(cluster, n, inner),
            replicate=group_link(cluster, s.dp_replicate, inner * n),
        )
    e = s.etp_size
    if e != s.tp:  # consecutive runs of e ranks inside each tp group
        links = dataclasses.replace(
            links,
            etp=group_link(cluster, e, st["tp"]),
            etp_rep=group_link(cluster, s.tp // e, st["tp"] * e),
        )
    if s.ep <= 1:
        return links
    ep_stride, edp_stride = expert_strides(s, st)
    groups, top_k = (1, 1), 1
    if spec is not None:
        groups, top_k = (spec.moe_n_groups, spec.moe_topk_groups), max(1, spec.moe_top_k)
    return dataclasses.replace(
        links,
        ep=group_link(cluster, s.ep, ep_stride),
        edp=group_link(cluster, s.edp, edp_stride),
        a2a=all_to_all_cost(cluster, s.ep, ep_stride, top_k, groups, dedup),
    )


@dataclass(frozen=True)
class Phase:
    """F/B/W seconds of one micro-batch, with the breakdown of where they come from."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0
    compute: float = 0.0  # GEMMs, attention and memory-bound kernels (F + B + W)
    recompute: float = 0.0
    tp_comm: float = 0.0  # exposed
    cp_comm: float = 0.0
    dp_comm: float = 0.0  # exposed ZeRO-3 gathers
    ep_comm: float = 0.0  # exposed expert-parallel dispatch/combine (and expert-tp gathers)

    def __add__(self, o: Phase) -> Phase:
        return Phase(
            self.f + o.f,
            self.b + o.b,
            self.w + o.w,
            self.compute + o.compute,
            self.recompute + o.recompute,
            self.tp_comm + o.tp_comm,
            self.cp_comm + o.cp_comm,
            self.dp_comm + o.dp_comm,
            self.ep_comm + o.ep_comm,
        )

    def scaled(self, k: float) -> Phase:
        return Phase(
            self.f * k,
            self.b * k,
            self.w * k,
            self.compute * k,
            self.recompute * k,
            self.tp_comm * k,
            self.cp_comm * k,
            self.dp_comm * k,
            self.ep_comm * k,
        )

    @property
    def total(self) -> float:
        return self.f + self.b + self.w


def _exposed(comm: float, compute: float, eta: float) -> float:
    return comm - eta * min(comm, compute)


@functools.lru_cache(maxsize=8192)
def gemm_passes(acc: HardwareProfile, gemms: tuple, fp8: bool) -> tuple[float, float, float]:
    """(forward, data-gradient, weight-gradient) seconds of a layer's GEMMs, each linear's
    three forms at their own shapes, with FP8's input quantisation (read 2 bytes, write 1)
    in every pass. Cached: a search meets the same layer under many strategies."""
    forms = [acc.gemm_times(g.m, g.n, g.k, fp8, g.count, g.groups) for g in gemms]
    f, b, w = (sum(t[i] for t in forms) for i in range(3))
    if fp8:
        quant = acc.memory_time(3.0 * sum(g.m * g.k for g in gemms))
        f, b, w = f + quant, b + quant, w + quant
    return f, b, w


def layer_phase(
    layer: Layer,
    spec: ModelSpec,
    s: Strategy,
    acc: HardwareProfile,
    links: Links,
    rt: Runtime,
    backward: bool = True,
    wgrad: bool = True,
) -> Phase:
    """F/B/W of one layer for one micro-batch (see module docstring). `backward=False`: a
    layer no gradient passes through (a frozen vision encoder), the forward only;
    `wgrad=False`: frozen weights, B without W (and without W's gradient casts)."""
    fp8 = s.fp8 and acc.supports_fp8
    gemm_f, gemm_b, gemm_w = gemm_passes(acc, layer.gemms, fp8)
    if spec.flash_attention:
        d, q = layer.head_dim, layer.seq
        heads = layer.attn_heads
        attn_f = acc.attention_time(layer.attn_flops, seq=q, head_dim=d, heads=heads)
        attn_b = acc.attention_time(2.5 * layer.attn_flops, True, q, d, heads)
    else:
        core = sum(acc.gemm_time(g.m, g.n, g.k, False, g.count) for g in layer.attn_gemms)
        attn_f = core + acc.memory_time(layer.core_bytes)
        attn_b = 2 * core + acc.memory_time(1.5 * layer.core_bytes)
    permute = layer.permute_bytes
    elem_f = acc.elementwise_time(layer.elementwise_bytes - permute) + acc.permute_time(permute)

    t, sp = s.tp, s.sp and s.tp > 1
    buf = layer.tp_buffer
    # Under autocast per op the column-parallel linears take the FP32 norm output: what sp
    # gathers for them, and the input gradient the backward reduces, are 4 B an element.
    wide = buf * rt.norm_out_bytes / 2
    if sp:
        tp_pass = 2 * (
            collective_time("all_gather", t, wide, links.tp)
            + collective_time("reduce_scatter", t, buf, links.tp)
        )
        regather = 2 * collective_time("all_gather", t, buf, links.tp) if rt.sharded_save else 0
        grad_pass = 2 * (
            collective_time("reduce_scatter", t, wide, links.tp)
            + collective_time("all_gather", t, buf, links.tp)
        )
    else:
        tp_pass, regather = 2 * collective_time("all_reduce", t, buf, links.tp), 0.0
        grads = [b * rt.norm_out_bytes / 2 for b in layer.tp_grad_buffers] or [wide, wide]
        grad_pass = sum(collective_time("all_reduce", t, b, links.tp) for b in grads)
    tp_f = _exposed(tp_pass, gemm_f, rt.tp_overlap)
    tp_b = _exposed(grad_pass, gemm_b, rt.tp_overlap)
    tp_w = _exposed(regather, gemm_w, rt.tp_overlap)
    cp_f, cp_b = context_comm(layer, s, links, rt, attn_f, attn_b)
    gather, rs, copy_f, copy_b = zero3_layer_traffic(spec, s, acc, links, rt)  # `fsdp.py`
    dp_f = _exposed(gather, gemm_f + attn_f, rt.fsdp_overlap)
    dp_b = _exposed(gather, gemm_b + attn_b, rt.fsdp_overlap) + _exposed(
        rs, gemm_b, rt.fsdp_overlap
    )
    ep_f, ep_b = expert_parallel_comm(layer, spec, s, links, rt)
    ep_f = _exposed(ep_f, gemm_f, rt.ep_overlap)
    ep_b = _exposed(ep_b, gemm_b, rt.ep_overlap)

    host = acc.layer_overhead_s  # not scaled with compute: the host runs it one-threaded
    # Autocast's eager casts. With FP32 parameters each forward casts the weights to BF16 and
    # the weight-gradient pass casts their BF16 gradients back (every micro-batch: the cast
    # cache lives for one autocast region; FP8 linears quantise the weights instead, which
    # `optimizer_time` counts). Per op, each linear's input is cast to BF16, and the backward
    # casts its gradient back and sums those of the linears that read the same norm output
    # (12 B per summed element).
    weight_cast = 0.0
    if rt.autocast_weight_copy and rt.param_bytes == 4 and not fp8:
        weight_cast = acc.cast_time(6.0 * sum(g.n * g.k * g.count for g in layer.gemms))
    cast_f = acc.cast_time(6.0 * layer.cast_elements) + weight_cast
    cast_b = acc.cast_time(6.0 * layer.cast_elements + 12.0 * layer.cast_sum_elements)
    f = gemm_f + attn_f + elem_f + cast_f + tp_f + cp_f + dp_f + ep_f + host / 3 + copy_f
    if not backward:
        return Phase(
            f=f,
            compute=gemm_f + attn_f + elem_f + cast_f + host / 3 + copy_f,
            tp_comm=tp_f,
            cp_comm=cp_f,
            dp_comm=dp_f,
            ep_comm=ep_f,
        )
    full, mods = parse_recompute(s.recompute)
    if full:  # the checkpointed block again, inside FSDP2's hooks: no second copy-out
        recompute = f - copy_f
    else:
        routed_act = layer.expert_act_bytes
        mla_up = "mla_up" in mods and spec.mla  # a region holding the core (DeepSeek)
        core = "core_attn" in mods or mla_up
        # the ring's exchanges live inside the attention core, so recomputing it re-runs
        # them; Ulysses' all-to-alls sit outside it
        ring = cp_f if s.cp_comm == "ring" else 0.0
        recompute = (attn_f + ring if core else 0.0) + (
            acc.elementwise_time(layer.act_bytes - routed_act) if "mlp_act" in mods else 0.0
        )
        recompute += acc.elementwise_time(layer.norm_bytes) if "norm" in mods else 0.0
        if "experts" in mods:  # the routed bank's forward again (and its EP dispatch)
            experts = [g for g in layer.gemms if g.name.startswith("experts_")]
            recompute += sum(acc.gemm_time(g.m, g.n, g.k, fp8, g.count) for g in experts)
            recompute += acc.elementwise_time(routed_act) + ep_f
        if mla_up:  # MLA's up-projections from the latents
            ups = [g for g in layer.gemms if g.name in ("wq_b", "wq", "wkv_b")]
            recompute += sum(acc.gemm_time(g.m, g.n, g.k, fp8, g.count) for g in ups)
    b = gemm_b + attn_b + 2 * elem_f + cast_b + tp_b + cp_b + dp_b + recompute + ep_b + 2 * host / 3
    b += copy_b
    gemms = gemm_f + gemm_b
    if wgrad:
        w = gemm_w + tp_w + weight_cast
        gemms += gemm_w
        compute = gemms + attn_f + attn_b + 3 * elem_f + cast_f + cast_b + weight_cast + host
    else:  # frozen weights: no W, nor its re-gathers and gradient casts
        w = tp_w = 0.0
        compute = gemms + attn_f + attn_b + 3 * elem_f + cast_f + cast_b + host
    return Phase(
        f=f,
        b=b,
        w=w,
        compute=compute + copy_f + copy_b,
        recompute=recompute,
        tp_comm=tp_f + tp_b + tp_w,
        cp_comm=cp_f + cp_b,
        dp_comm=dp_f + dp_b,
        ep_comm=ep_f + ep_b,
    )


def context_comm(
    layer: Layer, s: Strategy, links: Links, rt: Runtime, attn_f: float, attn_b: float
) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's context-parallel communication
    for one micro-batch, given the rank's attention time each way; 0 at cp = 1.

    Ring (load-balanced: rank i holds chunks i and 2cp-1-i, so each of the cp steps computes
    1/cp of the rank's attention): forward, cp-1 K/V exchanges, each behind one step;
    backward, cp-1 K/V exchanges and cp exchanges of the FP32 dK/dV accumulators, that of
    step i behind step i+1 (sharing the link with the K/V exchange there), the last exposed.
    Each exchange exposes ``comm - cp_overlap * min(comm, step)``. Ulysses: four all-to-alls
    of the local q, k, v and output (or of their gradients) each way, none hidden."""
    cp = s.cp
    if cp <= 1:
        return 0.0, 0.0
    width = rt.act_width
    if s.cp_comm == "alltoall":
        one = sum(links.cp_a2a.time(width * n) for n in layer.cp_a2a)
        return one, one
    kv = collective_time("p2p", cp, width * layer.cp_kv, links.cp_p2p)
    dkv = collective_time("p2p", cp, 4.0 * layer.cp_kv, links.cp_p2p)
    step_f, step_b, eta = attn_f / cp, attn_b / cp, rt.cp_overlap
    fwd = (cp - 1) * _exposed(kv, step_f, eta)
    bwd = _exposed(kv, step_b, eta)  # step 0 hides the first K/V exchange
    bwd += (cp - 2) * _exposed(kv + dkv, step_b, eta)  # steps 1..cp-2 hide both
    bwd += _exposed(dkv, step_b, eta) + dkv  # step cp-1 hides one dK/dV, the last is exposed
    return fwd, bwd


def expert_parallel_comm(
    layer: Layer, spec: ModelSpec, s: Strategy, links: Links, rt: Runtime
) -> tuple[float, float]:
    """(forward, backward) seconds of the mean layer's expert-parallel and expert-tensor-
    parallel communication for one micro-batch, before any overlap (module docstring); 0 at
    ep = 1 unless etp > 1 without sp."""
    if not layer.moe_fraction:
        return 0.0, 0.0
    e, sp = s.etp_size, s.sp and s.tp > 1
    fwd = bwd = 0.0
    if e > 1 and s.etp and not sp:  # every tp rank routes all tokens: partial sums over etp
        rows = rt.act_width * layer.routed_elements
        fwd = bwd = collective_time("all_reduce", e, rows, links.etp or links.tp)
    if s.ep <= 1 or not layer.dispatch_bytes:
        return layer.moe_fraction * fwd, layer.moe_fraction * bwd
    ar_f, ar_b = fwd, bwd
    imb = spec.moe_imbalance
    copies = layer.dispatch_bytes * imb  # what the busiest rank receives per all-to-all
    if s.dispatcher == "allgather":
        full = s.ep * layer.dispatch_bytes  # every rank's routed rows
        one = collective_time("all_gather", s.ep, full, links.ep) + collective_time(
            "reduce_scatter", s.ep, full, links.ep
        )
        fwd = bwd = one
    else:
        dispatch = copies / 2 if (s.fp8 and rt.fp8_dispatch) else copies
        fwd = links.a2a.time(dispatch) + links.a2a.time(copies)
        bwd = 2 * links.a2a.time(copies)
    fwd, bwd = fwd + ar_f, bwd + ar_b
    if e > 1 and (sp or not s.etp):  # the etp group gathers the rows, scatters the outputs
        link = links.etp or links.tp
        rows = e * copies
        etp = collective_time("all_gather", e, rows, link)
        etp += collective_time("reduce_scatter", e, rows, link)
        fwd, bwd = fwd + etp, bwd + etp
    return layer.moe_fraction * fwd, layer.moe_fraction * bwd


def embedding_phase(
    spec: ModelSpec,
    s: Strategy,
    seq: int,
    acc: HardwareProfile,
    links: Links,
    rt: Runtime | None = None,
    wgrad: bool = True,
):
    """First chunk: vocab-parallel lookup (the table's dtype: FP32 under autocast per op),
    then the all-reduce (or reduce-scatter) over tp; `wgrad=False`: a frozen table. With FP32
    main gradients (Megatron) each micro-batch forms the dense BF16 table gradient (zeroed, 2 B
    per vocab / tp x dim element) that the DDP hook adds to main_grad (10 B)."""
    tokens = s.mbs * seq / s.cp
    width = rt.param_bytes if rt is not None and rt.autocast_per_op else 2.0
    out = width * tokens * spec.dim
    kind = "reduce_scatter" if s.sp and s.tp > 1 else "all_reduce"
    comm = collective_time(kind, s.tp, out, links.tp)
    look = acc.elementwise_time(2 * out)
    w = acc.elementwise_time(3 * out) if wgrad else 0.0
    if wgrad and rt is not None and rt.fp32_main_grads:
        w += acc.memory_time(12.0 * spec.vocab_size / s.tp * spec.dim)
    return Phase(f=look + comm, w=w, compute=look + w, tp_comm=comm)


def head_phase(
    spec: ModelSpec,
    s: Strategy,
    seq: int,
    acc: HardwareProfile,
    links: Links,
    rt: Runtime | None = None,
    wgrad: bool = True,
):
    """Last chunk: final norm, vocab-parallel head GEMM and cross-entropy over V/tp logits
    (`wgrad=False`: a frozen head, no weight-gradient GEMM).

    Unfused (Megatron's and the reference path): the FP32 cross-entropy costs 34 B per logit
    forward (cast, max, subtract, exp, sum) and 22 backward (softmax, one-hot, scale, cast);
    TE's in-place kernel (`Runtime.ce_in_place`) reads the BF16 logits twice and writes their
    gradient over them (6 B), and its backward scales them in place (4 B).
    Fused (`rt.fused_cross_entropy`, `engine.ops.cross_entropy`): all three GEMMs and the
    softmax run in the forward, chunk by chunk; per logit the kernels read the BF16 logits
    three times (max, sum of exponentials, gradient) and write the BF16 gradient, 8 B, and
    per chunk the float32 ∂W takes a cast-add of the BF16 block (10 B per head weight);
    the backward only scales the two gradients in place.
    """
    tokens = s.mbs * seq / s.cp
    t = s.tp
    logits = tokens * spec.vocab_size / t
    x_sp = tokens * spec.dim / (t if s.sp and t > 1 else 1)
    fused = rt is not None and rt.fused_cross_entropy
    chunk = min(tokens, ce_chunk_tokens(tokens, spec.dim, spec.vocab_size / t)) if fused else 0
    chunks = math.ceil(tokens / chunk) if fused else 1
    # the head stays in BF16 (as in TransformerEngine recipes); the fused loss runs its three
    # GEMMs chunk by chunk
    rows = chunk if fused else tokens
    gemm_f, gemm_b, gemm_w = (
        chunks * g for g in acc.gemm_times(rows, spec.vocab_size / t, spec.dim, False)
    )
    comm_f = comm_b = 0.0
    if t > 1:
        # the head's input (the final norm's output: FP32 under autocast per op) is gathered
        # over sp and its gradient reduce-scattered back, or without sp the gradient is
        # all-reduced; the vocab-parallel loss all-reduces FP32 rows: per chunk the maximum
        # and (sum of exponentials, target logit) when fused, else the three over all tokens
        wide = (rt.norm_out_bytes if rt is not None else 2.0) * tokens * spec.dim
        if s.sp:
            comm_f = collective_time("all_gather", t, wide, links.tp)
            comm_b = collective_time("reduce_scatter", t, wide, links.tp)
        else:
            comm_b = collective_time("all_reduce", t, wide, links.tp)
        if fused:
            comm_f += chunks * sum(
                collective_time("all_reduce", t, w * chunk, links.tp) for w in (4.0, 8.0)
            )
        else:
            comm_f += 3 * collective_time("all_reduce", t, 4.0 * tokens, links.tp)
    if fused:
        weights = spec.vocab_size / t * spec.dim
        ce_f = acc.elementwise_time(8.0 * logits + 4.0 * x_sp) + acc.memory_time(
            10.0 * weights * chunks
        )
        if not wgrad:  # the operator forms no ∂W (nor its cast-adds)
            ce_f -= acc.memory_time(10.0 * weights * chunks)
        ce_b = acc.memory_time(8.0 * x_sp + (8.0 * weights if wgrad else 0.0))  # ∂h and ∂W
        gemms = gemm_f + gemm_b + (gemm_w if wgrad else 0.0)
        return Phase(
            f=gemms + ce_f + comm_f,
            b=ce_b + comm_b,
            compute=gemms + ce_f + ce_b,
            tp_comm=comm_f + comm_b,
        )
    if rt is not None and rt.ce_in_place:  # TE's kernel: read twice, gradient written in place
        ce_f = acc.elementwise_time(6.0 * logits + 4.0 * x_sp)
        ce_b = acc.elementwise_time(4.0 * logits + 8.0 * x_sp)
    else:
        ce_f = acc.elementwise_time(34.0 * logits + 4.0 * x_sp)
        ce_b = acc.elementwise_time(22.0 * logits + 8.0 * x_sp)
    return Phase(
        f=gemm_f + ce_f + comm_f,
        b=gemm_b + ce_b + comm_b,
        w=gemm_w if wgrad else 0.0,
        compute=gemm_f + gemm_b + (gemm_w if wgrad else 0.0) + ce_f + ce_b,
        tp_comm=comm_f + comm_b,
    )


def assign_layers(n_layers: int, rank_chunks: tuple[tuple[int, ...], ...]) -> list[int]:
    """Layers per model chunk, given the chunks each rank holds.

    Ranks first: the layers are spread as evenly as possible over the ranks, and when they
    cannot be even the ranks holding the first or last chunk (the embedding, the head) get
    fewer. Then each rank's layers are spread over its chunks, again lighter at the ends.
    Llama 3 405B on 16 stages: 7, 8 x 14, 7. A chunk that two ranks hold (DualPipe's copies)
    is cut once, evenly, with the ends lighter.
    """
    n_chunks = len({c for chunks in rank_chunks for c in chunks})
    ends = {0, n_chunks - 1}
    held = [c for chunks in rank_chunks for c in chunks]
    if len(held) != n_chunks:  # DualPipe: every chunk lives on two ranks
        q, r = divmod(n_layers, n_chunks)
        order = sorted(range(n_chunks), key=lambda c: (c in ends, c))
        return [q + (1 if c in order[:r] else 0) for c in range(n_chunks)]
    pp = len(rank_chunks)
    q, r = divmod(n_layers, pp)
    order = sorted(range(pp), key=lambda k: (len(ends & set(rank_chunks[k])), k))
    per_rank = [q + (1 if k in order[:r] else 0) for k in range(pp)]
    counts = [0] * n_chunks
    for k, chunks in enumerate(rank_chunks):
        qq, rr = divmod(per_rank[k], len(chunks))
        extra = sorted(chunks, key=lambda c: (c in ends, c))[:rr]
        for c in chunks:
            counts[c] = qq + (1 if c in extra else 0)
    return counts


def chunk_expert_params(spec: ModelSpec, tp: int, layers: list[int]) -> list[float]:
    """Routed-expert parameters per model chunk on one rank of a group of `tp` ranks that
    split each expert's width (tp, or `Strategy.etp`), before the ep split (the MTP module's
    experts on the last chunk)."""
    starts = [sum(layers[:i]) for i in range(len(layers))]
    out = [spec.chunk_layer_params(a, n)[1] / tp for a, n in zip(starts, layers, strict=True)]
    out[-1] += spec.mtp_expert_params() / tp
    return out


def local_params(
    spec: ModelSpec, tp: int, ep: int, layers: list[int], etp: int = 0
) -> tuple[list[float], list[float]]:
    """(parameters, of which routed experts) per model chunk on one rank: the tp split of
    `chunk_params` (the experts' over `etp`, 0 = tp) with 1/ep of the experts (at ep = 1:
    `chunk_params` and zeros)."""
    total = chunk_params(spec, tp, layers, etp)
    if ep <= 1:
        return total, [0.0] * len(layers)
    experts = chunk_expert_params(spec, etp or tp, layers)
    return [p - e + e / ep for p, e in zip(total, experts, strict=True)], [e / ep for e in experts]


def chunk_params(spec: ModelSpec, tp: int, layers: list[int], etp: int = 0) -> list[float]:
    """Parameters per model chunk on one tp rank (embedding on the first, head on the last),
    the routed experts split over `etp` ranks instead of tp when set (`Strategy.etp`); a
    vlm's encoder and projector on the first (`ModelSpec.vision_params`)."""
    if etp and etp != tp:
        dense = chunk_params(spec, tp, layers)
        tp_experts = chunk_expert_params(spec, tp, layers)
        experts = chunk_expert_params(spec, etp, layers)
        return [p - a + b for p, a, b in zip(dense, tp_experts, experts, strict=True)]
    out = []
    for i, n in enumerate(layers):
        p = spec.chunk_layer_params(sum(layers[:i]), n)[0]
        if i == 0:
            p += spec.embedding_params()
        if i == len(layers) - 1:
            p += spec.dim + (spec.embedding_params() if not spec.tie_embeddings or i else 0)
            p += spec.mtp_params()
        out.append(p / tp + (spec.vision_params(tp)[0] if i == 0 else 0.0))
    return out


def chunk_frozen_params(spec: ModelSpec, tp: int, params: list[float]) -> list[float]:
    """Frozen parameters per model chunk on one tp rank (no gradient, no optimizer state),
    given the chunk's parameters `params`: a vlm's frozen encoder and projector parts (the
    unused encoder blocks always) on the first, every decoder parameter when the decoder is
    frozen."""
    if not spec.vision:
        return [0.0] * len(params)
    total, frozen = spec.vision_params(tp)
    out = [p - (total if i == 0 else 0.0) if spec.frozen("decoder") else 0.0
           for i, p in enumerate(params)]  # fmt: skip
    out[0] += frozen
    return out


@dataclass(frozen=True)
class StepExtras:
    """Per-step costs after a rank's last backward."""

    dp_total: float  # all data-parallel traffic of the step
    dp_exposed: float
    optimizer: float


def dp_sync(
    params: float,
    f_window: float,
    b_window: float,
    s: Strategy,
    links: Links,
    rt: Runtime,
    expert: float = 0.0,
    etp_expert: float = 0.0,
) -> tuple[float, float]:
    """(total, exposed) seconds of the step's data-parallel gradient/parameter traffic for a
    rank holding `params`, of which `expert` are its local routed experts (reduced over the
    expert-data-parallel group when ep > 1); `b_window`/`f_window` are its last backward /
    first forward. `etp_expert`: the rank's local routed experts when sp routes each tp
    rank's own tokens through experts split over etp < tp ranks, whose gradients are summed
    over the tp / etp ranks holding the same slices after the backward (not overlapped), as
    the gradients are held then (`ParallelModel.finish_grads`): whole, or under FSDP2 the
    shards over the experts' replicas (dp x cp / ep ranks; at ep = 1 the block's dp x cp)."""
    total, exposed = _dp_sync(params, f_window, b_window, s, links, rt, expert)
    e = s.etp_size
    if etp_expert and s.sp and e < s.tp and links.etp_rep is not None:
        width = rt.grad_bytes * etp_expert / (s.dcp // s.ep if s.zero == 3 else 1)
        extra = collective_time("all_reduce", s.tp // e, width, links.etp_rep)
        total, exposed = total + extra, exposed + extra
    return total, exposed


def _dp_sync(
    params: float,
    f_window: float,
    b_window: float,
    s: Strategy,
    links: Links,
    rt: Runtime,
    expert: float = 0.0,
) -> tuple[float, float]:
    """`dp_sync` over the data-parallel groups (dense and expert-data-parallel)."""
    hsdp = s.zero == 3 and s.dp_replicate > 1 and links.shard is not None
    groups = [(params - expert, s.fsdp_shard, links.shard if hsdp else links.dp)]
    if expert:
        groups.append((expert, s.edp, links.edp))
    groups = [g for g in groups if g[1] > 1]
    if not groups:
        return 0.0, 0.0

    def coll(kind: str, width: float) -> float:
        return sum(collective_time(kind, n, width * p, lk) for p, n, lk in groups)

    p0, n0, link0 = groups[0]
    bucket = min(rt.grad_reduce_bytes * p0, rt.bucket_mb * 2**20)
    if s.zero == 0:
        total = coll("all_reduce", rt.grad_reduce_bytes)
        last = collective_time("all_reduce", n0, bucket, link0)
        return total, max(last, _exposed(total, b_window, rt.ddp_overlap))
    if s.zero == 1:
        if rt.zero1_in_place:  # gloo: gradients, then the FP32 weights, all-reduced whole
            first, second, width = "all_reduce", "all_reduce", 4
        else:
            first, second, width = "reduce_scatter", "all_gather", rt.param_gather_bytes
        rs = coll(first, rt.grad_reduce_bytes)
        ag = coll(second, width)
        last = collective_time(first, n0, bucket, link0)
        exposed = max(last, _exposed(rs, b_window, rt.zero1_overlap))
        return rs + ag, exposed + _exposed(ag, f_window, rt.zero1_overlap)
    if not rt.fsdp_unsharded_accumulation:
        return 0.0, 0.0  # reduce-scattered per micro-batch inside B (layer_phase)
    rs = coll("reduce_scatter", rt.grad_reduce_bytes)
    last = collective_time("reduce_scatter", n0, bucket, link0)
    if hsdp:  # then the replica groups all-reduce the reduce-scattered shards
        shard = rt.grad_reduce_bytes * p0 / n0
        rs += collective_time("all_reduce", s.dp_replicate, shard, links.replicate)
        last += collective_time("all_reduce", s.dp_replicate, bucket / n0, links.replicate)
    return rs, max(last, _exposed(rs, b_window, rt.fsdp_overlap))


def shared_grad_groups(
    spec: ModelSpec, tp: int, rank_chunks: tuple[tuple[int, ...], ...], params: tuple[float, ...]
) -> list[tuple[tuple[int, ...], float]]:
    """(pipeline ranks, parameters) whose gradients the pipeline runtime sums over a subgroup
    of those ranks after the last backward (`PipelineModel.sum_shared_grads`): a chunk held by
    several ranks (DualPipe's two model copies) and, with tied embeddings, the table shared by
    the first chunk's and the last chunk's ranks. `params` are per chunk on one rank, as
    `chunk_params` counts them (the tied head's copy on the last chunk); groups of one rank
    sum in memory and are left out. Sorted by ranks, the order the runtime issues them."""
    chunks = range(len(params))
    holders = [tuple(r for r, mine in enumerate(rank_chunks) if c in mine) for c in chunks]
    by_ranks: dict[tuple[int, ...], float] = {}
    last = len(params) - 1
    tied = spec.tie_embeddings and last > 0
    table = spec.embedding_params() / tp
    for c, ranks in enumerate(holders):
        p = params[c] - (table if tied and c in (0, last) else 0.0)
        by_ranks[ranks] = by_ranks.get(ranks, 0.0) + p
    if tied:
        ranks = tuple(sorted(set(holders[0]) | set(holders[last])))
        by_ranks[ranks] = by_ranks.get(ranks, 0.0) + table
    return sorted((r, p) for r, p in by_ranks.items() if len(r) > 1 and p > 0)


def optimizer_time(
    params: float, s: Strategy, acc: HardwareProfile, rt: Runtime, expert: float = 0.0
) -> float:
    """Adam over the rank's optimizer shard, as memory traffic: read p, g, m, v and write p,
    m, v (28 B per FP32 element; a separate master adds 10: the shard's norm read and the
    BF16 copy, read 4 + write 2), plus two passes over the local gradients (ZeRO-3: their
    shard): zeroing and a norm read (Megatron's NaN check of every bucket), and FP8 weight
    casts. The `expert` part of `params` is sharded over the expert-data-parallel group.
    ZeRO-1 adds what the runtime's own step moves beyond that (`Runtime.zero1_step_extra`,
    `Runtime.zero1_publish_bytes`); Megatron its pre-reduction scaling and the clip
    (`Runtime.grad_prescale`, `Runtime.clip_shard_bytes`)."""
    shard = params / (s.fsdp_shard if s.zero == 3 else s.dcp) if s.zero in (1, 3) else params
    if expert and s.zero in (1, 3):
        shard = (params - expert) / s.dcp + expert / s.edp
    per = 28.0 + (10.0 if rt.param_bytes != 4 else 0.0) + rt.clip_shard_bytes
    grads = shard if s.zero == 3 else params  # ZeRO-3 holds (and clips) gradient shards
    passes = 2 + (2 if rt.grad_prescale and s.dcp > 1 else 0)
    nbytes = shard * per + grads * passes * rt.grad_bytes
    if s.zero == 1 and s.dcp > 1:  # the runtime's own ZeRO-1 step and publication
        nbytes += shard * rt.zero1_step_extra + params * rt.zero1_publish_bytes
    if s.fp8:
        nbytes += params * (rt.param_bytes + 2)
    return acc.memory_time(nbytes)
