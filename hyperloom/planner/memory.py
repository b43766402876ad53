"""Bytes per rank: model states, activations in flight, buffers, allocator headroom.

Model states (ZeRO, arXiv 1910.02054), with p, g, o bytes per parameter for the stored
parameter, gradient and optimizer state (Adam's moments, plus an FP32 master if the parameter
is not one) and P the parameters a rank holds:

    zero 0:  P * (p + g + o)        zero 1:  P * (p + g) + P * o / dp
    zero 3:  P * (p + g + o) / dp   (FSDP2 under no_sync keeps P * g unsharded)

Routed experts count 1/ep, their sharded states over dp * cp / ep, their width 1/etp
(`Strategy.etp`; 1/tp when unset). Under HSDP (`Strategy.dp_replicate`) ZeRO-3 shards over
one replica group, dp * cp / dp_replicate ranks.

Activations (arXiv 2205.05198; `model.build_layer` lists the tensors): a chunk's saved bytes
per micro-batch under the recompute policy, times the peak in-flight (stage, micro-batch)
units read from the schedule replay (`pipeline.validate`), plus Zero Bubble's W-pending
units at their weight-gradient inputs -- so interleaving's (p - 1)/(pv) and the m < p case
come out of the schedule, not a formula.

A vlm's encoder and projector add their saved bytes, W-pending bytes and backward working
set to the first chunk (`vision.tower_memory`); frozen parameters (`ModelSpec.frozen`) hold
their weights only, whole under ZeRO.

On top: one backward's transient working set, autocast and FP8 weight copies, DDP's bucket
copy or ZeRO-1's gradient copy where the runtime makes one, TE's cached dummy weight
gradients (`Runtime.te_dummy_wgrad`), FSDP2's gathered layers and root (`fsdp_buffers`), expert
dispatch buffers, one layer's context-parallel attention buffers (`cp_buffer`). Reserved =
peak / 0.94 (SimuMax's ``mem_factor``), and a plan keeps a margin (6 GiB) for the context and
NCCL. A CPU profile's ``host_runtime_bytes`` and
``host_churn_factor`` (`host_memory.py`) turn live bytes into resident bytes.

`grads_at_peak`: Megatron's gradient buffers are persistent; hyperloom frees gradients after
each step and a rank peaks at its first backward, so only what holds them (DDP views, ZeRO-1's
flat buffer, accumulation without a pipeline) counts them; `step_peak` counts all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from hyperloom.planner.model import Layer, ModelSpec, parse_recompute
from hyperloom.planner.strategy import Runtime, Strategy

if TYPE_CHECKING:
    from hyperloom.planner.vision import TowerMemory

ALLOC_FACTOR = 0.94


@dataclass(frozen=True)
class Memory:
    """One rank's peak memory, bytes, by component."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0  # in-flight saved tensors (incl. Zero Bubble's W-pending)
    transient: float = 0.0  # one backward's working set
    buffers: float = 0.0  # autocast/FP8 weight copies, DDP buckets, FSDP gathers
    step_peak: float = 0.0  # states + optimizer-step temporaries (activations freed)
    allocator: float = 0.0  # host allocator's freed-but-resident pages (CPU, host_memory.py)
    # Gradient bytes held at the activation peak, where they differ from `grads`
    # (`grads_at_peak`); None: all of them.
    peak_grads: float | None = None

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def grads_held(self) -> float:
        """Gradient bytes held at the activation peak."""
        return self.grads if self.peak_grads is None else self.peak_grads

    @property
    def activation_peak(self) -> float:
        """Bytes at the activation peak: the sum of the parts held then (params, the grads
        held, optimizer, activations, transient, buffers) and the allocator's pages."""
        run = self.params + self.grads_held + self.optimizer + self.activations
        return run + self.transient + self.buffers + self.allocator

    @property
    def live(self) -> float:
        """Peak bytes held by tensors: the activation peak's or the optimizer step's."""
        return max(self.activation_peak - self.allocator, self.step_peak)

    @property
    def peak(self) -> float:
        return self.live + self.allocator

    @property
    def reserved(self) -> float:
        return self.peak / ALLOC_FACTOR

    def to_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.update(states=self.states, live=self.live, peak=self.peak, reserved=self.reserved)
        d["activation_peak"] = self.activation_peak
        if self.peak_grads is None:
            d["peak_grads"] = self.grads
        return d


def saved_bytes(layer: Layer, recompute: str, fp8: bool = False) -> float:
    """Bytes one layer keeps for its backward, per micro-batch, under `recompute`."""
    full, mods = parse_recompute(recompute)
    total = 0.0
    for t in layer.saved:
        if full and t.module != "input":
            continue
        if t.module in mods or t.also in mods:
            continue
        total += t.nbytes / 2 if (fp8 and t.gemm_input) else t.nbytes
    return total


def w_pending_bytes(layer: Layer, fp8: bool = False) -> float:
    """What a unit waiting for its deferred W keeps: GEMM inputs and output gradients."""
    inputs = sum(t.nbytes for t in layer.saved if t.gemm_input)
    return (inputs / 2 if fp8 else inputs) + layer.grad_out_bytes


def states(
    params: float, s: Strategy, rt: Runtime, expert: float = 0.0
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes for `params` parameters on one rank, of which `expert`
    are local routed experts sharded over the expert-data-parallel group (ep > 1)."""
    if expert and s.zero != 0:
        dense = states(params - expert, s, rt)
        ours = states(expert, dataclasses.replace(s, dp=s.edp, cp=1, ep=1), rt)
        return tuple(a + b for a, b in zip(dense, ours, strict=True))
    # ZeRO shards over every rank that holds these parameters (ZeRO-3: one HSDP group of them)
    dp = s.fsdp_shard if s.zero == 3 else s.dcp
    master = 4 if (rt.param_bytes != 4 or (s.zero == 1 and rt.zero1_separate_master)) else 0
    opt = (8 + master) * params
    p, g = rt.param_bytes * params, rt.grad_bytes * params
    if s.zero == 0:
        return p, g, opt
    if s.zero == 1:
        return p, g, opt / dp
    grads = g if (rt.fsdp_unsharded_accumulation and s.microbatches > 1) else g / dp
    return p / dp, grads, opt / dp


def ce_chunk_tokens(tokens: float, dim: int, vocab: float) -> int:
    """Tokens per chunk of the fused cross-entropy: `engine.ops.cross_entropy.
    auto_chunk_tokens` (Liger's ~tokens*dim/vocab, a power of two, at least 256)."""
    n = int(tokens)
    per_chunk = -(-n // max(1, -(-int(vocab) // dim)))
    return max(256, 1 << (per_chunk - 1).bit_length())


def chunk_activation_extras(
    spec: ModelSpec,
    s: Strategy,
    seq: int,
    first: bool,
    last: bool,
    fused_ce: bool = False,
    act_width: float = 2.0,
    ce_in_place: bool = False,
):
    """Saved bytes of a chunk beyond its layers: on the last chunk the final norm's input and
    either the head's input and FP32 logits or, with the fused cross-entropy
    (`engine/ops/cross_entropy.py`), the FP32 input and weight gradients its forward already
    formed (tokens x dim and the vocab/tp x dim head slice, kept until backward), or, fused
    in place (`Runtime.ce_in_place`, TE's kernel), the logits in the activation dtype holding
    their gradient; the embedding dropout mask (first, GPT-style models)."""
    tokens = s.mbs * seq / s.cp
    sp = s.sp and s.tp > 1
    x_sp = tokens * spec.dim / (s.tp if sp else 1)
    out = 0.0
    if first and spec.dropout:
        out += x_sp
    if last:  # and per MTP depth its own head input and logits

        def head(n: float) -> float:  # one head's, for n tokens on this rank
            x = n * spec.dim / (s.tp if sp else 1)
            if fused_ce:
                return act_width * x + 4.0 * n * spec.dim + 4.0 * spec.vocab_size * spec.dim / s.tp
            logit = act_width if ce_in_place else 4.0
            return 2 * act_width * x + logit * n * spec.vocab_size / s.tp

        # MTP runs on whole sequences on each cp rank (models.deepseek)
        out += head(tokens) + spec.mtp_depth * head(tokens * s.cp)
    return out


def ce_working_bytes(spec: ModelSpec, s: Strategy, seq: int) -> float:
    """The fused cross-entropy forward's temporaries on the last chunk: the BF16 weight copy
    and the BF16 block of ∂W reused by every chunk (2 B per head weight each, the block at
    most `GRAD_W_BLOCK_BYTES`) and, per chunk of c tokens, 16 B per logit (BF16 logits, their
    FP32 upcast and exponentials, the FP32 softmax gradient and its BF16 cast). The
    coefficients are what `AllocationTracker` sees the operator allocate on two shapes
    (tests/unit/test_planner_host_memory.py)."""
    from hyperloom.engine.ops.cross_entropy import GRAD_W_BLOCK_BYTES

    tokens = s.mbs * seq / s.cp
    vocab = spec.vocab_size / s.tp
    c = min(tokens, ce_chunk_tokens(tokens, spec.dim, vocab))
    weight = 2.0 * vocab * spec.dim
    return weight + min(weight, GRAD_W_BLOCK_BYTES) + 16.0 * c * vocab


@dataclass(frozen=True)
class LayerMemory:
    """A layer's memory figures under one recompute policy (computed once per strategy)."""

    saved: float  # per micro-batch, kept for the backward
    w_pending: float  # kept while waiting for a deferred W
    working: float  # one backward's working set: recomputed tensors + gradient buffers
    dispatch: float = 0.0  # one MoE layer's expert-parallel dispatch buffers
    # what the forward allocates per micro-batch whatever it keeps (the no-recompute saved
    # bytes): recompute frees it sooner, but a host allocator churns through all of it
    allocated: float = 0.0
    cp: float = 0.0  # one layer's context-parallel attention buffers (`cp_buffer`)

    @classmethod
    def of(
        cls, layer: Layer, recompute: str, fp8: bool, dispatch: float = 0.0, cp: float = 0.0
    ) -> LayerMemory:
        saved = saved_bytes(layer, recompute, fp8)
        biggest = max(t.nbytes for t in layer.saved)
        every = saved_bytes(layer, "none", fp8)
        working = every - saved + 2 * biggest
        return cls(saved, w_pending_bytes(layer, fp8), working, dispatch, every, cp)


def dispatch_buffer(layer: Layer, spec: ModelSpec, s: Strategy) -> float:
    """Bytes of one MoE layer's dispatch buffers under expert parallelism (module docstring):
    the all-to-all's send buffer and the busiest rank's receive buffer, or the all-gather
    dispatcher's gathered rows and its outputs before the reduce-scatter."""
    if s.ep <= 1 or not layer.dispatch_bytes:
        return 0.0
    if s.dispatcher == "allgather":
        return 2.0 * s.ep * layer.dispatch_bytes
    return layer.dispatch_bytes * (1.0 + spec.moe_imbalance)


def cp_buffer(layer: Layer, s: Strategy, act_width: float = 2.0) -> float:
    """Bytes one layer's attention holds while it crosses the context-parallel ranks (0 at
    cp = 1). Ring: two K/V blocks (the one computed on, the one arriving) and, forward, the
    FP32 output and log-sum-exp accumulators, or, backward, the FP32 dQ and two FP32 dK/dV
    blocks (the one accumulating, the one in flight), whichever is larger. Ulysses: the
    re-sharded q, k, v and output (heads/cp over the whole sequence: the local sizes)."""
    if s.cp <= 1:
        return 0.0
    if s.cp_comm == "alltoall":
        return act_width * sum(layer.cp_a2a)
    blocks = 2.0 * act_width * layer.cp_kv
    dq = layer.cp_a2a[0]  # the local queries' elements
    return blocks + max(4.0 * layer.cp_acc, 4.0 * (dq + 2.0 * layer.cp_kv))


def fsdp_buffers(
    spec: ModelSpec, s: Strategy, rt: Runtime, layer_params: float, first: bool, last: bool
) -> float:
    """FSDP2's unsharded buffers at the activation peak, per rank: two blocks gathered at the
    gather width (`Runtime.param_gather_bytes`: the block running and the one prefetched)
    and one block's unsharded gradient at the gradient width, plus the root module's
    parameters (embedding; final norm and head), which FSDP2 gathers at the root's forward
    and does not free until its backward (`FSDPState._lazy_init` sets the root's
    post-forward reshard off: they would be gathered again at once)."""
    width = rt.param_gather_bytes
    table = spec.embedding_params() / s.tp
    root = table if first else 0.0  # a tied head on the first chunk shares the table
    if last:
        root += spec.dim + (table if not (spec.tie_embeddings and first) else 0.0)
    return 2.0 * width * layer_params + rt.grad_bytes * layer_params + width * root


def grads_at_peak(
    spec: ModelSpec, s: Strategy, rt: Runtime, grads: float, last_chunk: bool
) -> float | None:
    """Gradient bytes a rank holds at its activation peak when the runtime frees them every
    step (`Runtime.grads_freed_each_step`), None when all of them are held (Megatron's
    persistent gradient buffers).

    A single micro-batch peaks at the start of its backward, before any gradient exists but
    those the forward formed: the fused loss's head gradient on the last chunk. A pipeline's
    warm-up does the same: it fills the rank's in-flight units before its first backward.
    DDP's bucket views (ZeRO-1's flat buffer) keep every gradient allocated, and accumulation
    over micro-batches without a pipeline (grad_accum) holds them from the first backward on;
    the fused loss's head gradient then comes on top until the backward adds it in."""
    if not rt.grads_freed_each_step:
        return None
    head = 0.0
    if last_chunk and rt.fused_cross_entropy and not spec.frozen("decoder"):
        # tied or not, the head's weight gradient
        head = rt.grad_bytes * spec.embedding_params() / s.tp
    # pipelines: the warm-up reaches the peak before the rank's first backward
    held = (s.dcp > 1 and s.zero in (0, 1)) or (s.pp == 1 and s.microbatches > 1)
    return (grads if held else 0.0) + head


def rank_memory(
    spec: ModelSpec,
    s: Strategy,
    rt: Runtime,
    seq: int,
    lm: LayerMemory,
    chunks: tuple[int, ...],
    layers: list[int],
    chunk_params: list[float],
    in_flight: int,
    w_pending: int,
    chunk_experts: list[float] | None = None,
    host: tuple[float, float, float] = (1.0, 0.0, 0.0),
    chunk_frozen: list[float] | None = None,
    tower: TowerMemory | None = None,
) -> Memory:
    """Peak memory of a rank that holds the model `chunks` (indices into `layers`), with the
    schedule's peak in-flight and W-pending (stage, micro-batch) counts for that rank;
    `chunk_params` are local (1/ep of the routed experts), `chunk_experts` the part of them
    that is local routed experts (ep > 1); `host` is the accelerator profile's
    `HardwareProfile.host_memory`: what a CPU process keeps resident beyond the live bytes
    (nothing on devices). `chunk_frozen`: the frozen part of `chunk_params` (parameter bytes
    only, whole under ZeRO); `tower`: a vlm's encoder and projector on the first chunk
    (`vision.tower_memory`)."""
    last = len(layers) - 1
    params = sum(chunk_params[c] for c in chunks)
    frozen = sum(chunk_frozen[c] for c in chunks) if chunk_frozen else 0.0
    expert = sum(chunk_experts[c] for c in chunks) if chunk_experts and s.ep > 1 else 0.0
    p, g, o = states(params - frozen, s, rt, expert)
    p += rt.param_bytes * frozen
    first = tower if tower is not None and 0 in chunks else None
    unit = max(
        (layers[c] + (spec.mtp_depth * s.cp if c == last else 0)) * lm.saved
        + chunk_activation_extras(
            spec, s, seq, c == 0, c == last, rt.fused_cross_entropy, rt.act_width, rt.ce_in_place
        )
        + (first.saved if first is not None and c == 0 else 0.0)
        for c in chunks
    )
    n_layers = sum(layers[c] for c in chunks)
    activations = in_flight * unit + w_pending * max(layers[c] for c in chunks) * lm.w_pending
    if first is not None:
        activations += w_pending * first.w_pending

    # One backward's working set: a recomputed layer plus gradient buffers and its
    # context-parallel attention buffers; on the last chunk the cross-entropy's BF16 logits
    # and FP32 temporaries (its saved FP32 exp is in the chunk extras), or the fused
    # operator's chunk temporaries. The encoder's backward runs apart from the decoder's.
    transient = lm.working + lm.cp
    if first is not None:
        transient = max(transient, first.working)
    if last in chunks:
        if rt.fused_cross_entropy:
            transient = max(transient, ce_working_bytes(spec, s, seq))
        elif not rt.ce_in_place:  # in place: three FP32 numbers per row beside the logits
            logits = s.mbs * seq / s.cp * spec.vocab_size / s.tp
            transient = max(transient, 10.0 * logits)

    layer_params = spec.layer_params() / s.tp
    layer_matmul = spec.layer_matmul_params()
    if s.ep > 1:  # 1/ep of the routed experts
        shed = spec.layer_expert_params() * (1 - 1 / s.ep)
        layer_params -= shed / s.tp
        layer_matmul -= shed
    # per rank: the local routed experts split over etp instead of tp (`Strategy.etp`)
    fp8_weights = n_layers * layer_matmul / s.tp
    if s.etp_size != s.tp:
        local = spec.layer_expert_params() / s.ep
        layer_params += local * (1 / s.etp_size - 1 / s.tp)
        fp8_weights += n_layers * local * (1 / s.etp_size - 1 / s.tp)
    buffers = lm.dispatch
    if rt.autocast_weight_copy:
        cast = params
        if rt.autocast_per_op:  # no cast of the embedding; the fused loss casts the head itself
            vocab = spec.embedding_params() / s.tp
            cast -= vocab if 0 in chunks else 0.0
            if last in chunks and rt.fused_cross_entropy and not spec.tie_embeddings:
                cast -= vocab
        buffers += 2.0 * max(cast, 0.0)
    if first is not None:
        fp8_weights += first.fp8_weights
    if s.fp8:
        buffers += 2.0 * fp8_weights
    if rt.te_dummy_wgrad and not spec.frozen("decoder"):
        routed = 3.0 * spec.dim * spec.moe_ffn_dim if spec.n_routed_experts else 0.0
        buffers += 2.0 * ((spec.weight_shapes_params() - routed) / s.tp + routed / s.etp_size)
    trainable = params - frozen
    if s.zero == 0 and s.dcp > 1 and rt.ddp_bucket_copy:
        buffers += rt.grad_bytes * trainable
    if s.zero == 3 and s.dcp > 1 and not spec.frozen("decoder"):
        buffers += fsdp_buffers(spec, s, rt, layer_params, 0 in chunks, last in chunks)
    step_peak = p + g + o
    if s.zero == 1 and s.dcp > 1 and rt.zero1_separate_master and rt.param_bytes != 4:
        # BF16 parameters' gradients flattened into an FP32 copy for the sharded step; not
        # where they accumulate in one FP32 buffer already (Megatron's main_grad)
        step_peak += 0.0 if rt.fp32_main_grads else 4.0 * trainable
    live = Memory(
        params=p,
        grads=g,
        optimizer=o,
        activations=activations,
        transient=transient,
        buffers=buffers,
        step_peak=step_peak,
        peak_grads=grads_at_peak(spec, s, rt, g, last in chunks),
    )
    factor, fixed, churn = host
    if factor == 1.0 and not fixed and not churn:
        return live
    # what a step allocates and frees: the in-flight activations as the forward allocates
    # them (recompute or not: it drops them sooner, the allocator churns through them all),
    # the backward's working set and the per-micro-batch weight casts. Measured: resident
    # minus live bytes is 0.80 GB without recompute and 0.95 GB under full recompute (the
    # default model, 4 x 2048 tokens, fp32; benchmarks/planner_memory_probe.py).
    blocks = max(layers[c] + (spec.mtp_depth * s.cp if c == last else 0) for c in chunks)
    churned = activations + in_flight * blocks * (lm.allocated - lm.saved)
    churned += transient + buffers
    extra = (factor - 1.0) * live.live + fixed + churn * churned
    return dataclasses.replace(live, allocator=extra)
