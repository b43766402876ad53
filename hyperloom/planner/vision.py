"""A vision-language model's encoder and projector: their F/B/W and memory on the first stage.

`hyperloom.models.vlm` puts a ViT encoder and a projector before the decoder, on the first
pipeline stage with the embedding (`models/vlm/plan.py`). Per micro-batch of `mbs` samples
the stage runs i = mbs x `ModelSpec.images_per_sample` images (one per sample unless said
otherwise, as `models.vlm.accounting` assumes), each n = patches (+ class token) positions:

- the patch embedding, one GEMM of (i x patches) x vision_dim x 3 p², replicated over tp,
  plus the position add and pre-norm;
- `vision_depth` encoder blocks (`model.build_vision_block`, costed by `costs.layer_phase`
  like a decoder layer, recompute policy included), tp-split by heads and MLP width and run
  on whole image sequences: with sp too, two all-reduces each way;
- the projector on i x tokens_per_image rows: an MLP's linear_1 by columns, linear_2 by rows
  (one all-reduce forward, one of the features' gradient backward), or one replicated linear;
- the merge of the features into the embeddings, which under sp all-reduces the whole
  sequence's embeddings where a decoder reduce-scatters them (the difference is charged here).

Frozen parts (`ModelSpec.frozen`) follow autograd: a frozen encoder needs no backward at all
(its input, the pixels, needs none), saves nothing and has no W; a frozen projector has no W
but still passes its input gradient back when the encoder trains; the projector's linear_1
input gradient is formed only when the encoder trains. Frozen weights keep their parameter
bytes only (`memory.rank_memory`). Not modelled: the encoder's ZeRO-3 gathers' memory (the
decoder's gathered layer is larger), and any per-parameter freezing finer than the parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hyperloom.planner.collectives import collective_time
from hyperloom.planner.costs import Links, Phase, _exposed, layer_phase
from hyperloom.planner.hardware import HardwareProfile
from hyperloom.planner.memory import LayerMemory, saved_bytes, w_pending_bytes
from hyperloom.planner.model import Gemm, ModelSpec, build_vision_block
from hyperloom.planner.strategy import Runtime, Strategy


@dataclass(frozen=True)
class TowerMemory:
    """What the encoder and projector add to the first chunk's memory (bytes on one rank)."""

    saved: float = 0.0  # kept for the backward, per micro-batch in flight
    working: float = 0.0  # one encoder block's backward working set
    w_pending: float = 0.0  # kept per unit waiting for its deferred W (Zero Bubble)
    fp8_weights: float = 0.0  # elements of the matrices that run in FP8 (their copies)


def images_per_microbatch(spec: ModelSpec, s: Strategy) -> float:
    return s.mbs * spec.images_per_sample


def _tower_strategy(s: Strategy) -> Strategy:
    """The layout the encoder blocks run in: whole image sequences (no sp, no cp), no
    experts; ZeRO-3's gathers are costed by `_zero3` with the encoder's own sizes."""
    return dataclasses.replace(s, sp=False, cp=1, ep=1, zero=0, etp=0)


def projector_gemms(spec: ModelSpec, images: float, tp: int) -> tuple[Gemm, ...]:
    rows, h = images * spec.tokens_per_image, spec.dim
    if not spec.projector_mlp:
        return (Gemm("p_linear_1", rows, h, spec.projector_in),)
    return (
        Gemm("p_linear_1", rows, h / tp, spec.projector_in),
        Gemm("p_linear_2", rows, h, h / tp),
    )


def tower_forward_flops(spec: ModelSpec, images: float, tp: int = 1) -> float:
    """Forward FLOPs of the encoder's running blocks, patch embedding and projector for
    `images` images on one of `tp` ranks (the replicated GEMMs whole on every rank)."""
    block = build_vision_block(spec, images, tp)
    patch = Gemm(
        "patch", images * spec.vision_patches, spec.vision_dim, 3 * spec.config.patch_size**2
    )
    proj = sum(g.flops for g in projector_gemms(spec, images, tp))
    return spec.vision_depth * (block.gemm_flops + block.attn_flops) + patch.flops + proj


def tower_phase(
    spec: ModelSpec, s: Strategy, seq: int, acc: HardwareProfile, links: Links, rt: Runtime
) -> Phase:
    """F/B/W seconds of the encoder and projector for one micro-batch (module docstring)."""
    images = images_per_microbatch(spec, s)
    if not spec.vision or images <= 0:
        return Phase()
    fp8 = s.fp8 and acc.supports_fp8
    t, A = s.tp, rt.act_width  # noqa: N806 - bytes per activation element
    vision, proj = not spec.frozen("vision"), not spec.frozen("projector")
    block = build_vision_block(spec, images, t, rt.autocast_per_op, rt.act_width)
    blocks = layer_phase(block, spec, _tower_strategy(s), acc, links, rt, backward=vision)
    blocks = blocks.scaled(spec.vision_depth) + _zero3(spec, s, links, rt, blocks, vision)

    # patch embedding (no input gradient: the pixels), position add, pre-norm
    d, n = spec.vision_dim, spec.vision_positions
    x = images * n * d
    patch = acc.gemm_time(images * spec.vision_patches, d, 3 * spec.config.patch_size**2, fp8)
    embed_bytes = 6.0 * x + (4.0 * x if spec.config.vision_pre_norm else 0.0)
    embed_f = patch + acc.elementwise_time(embed_bytes)
    embed = Phase(f=embed_f, compute=embed_f)
    if vision:  # backward twice the forward's traffic; the patch GEMM's W only
        embed_b = acc.elementwise_time(2 * embed_bytes)
        embed = Phase(f=embed_f, b=embed_b, w=patch, compute=embed_f + embed_b + patch)

    # projector
    rows = images * spec.tokens_per_image
    gemms = projector_gemms(spec, images, t)
    times = [acc.gemm_time(g.m, g.n, g.k, fp8, g.count) for g in gemms]
    gelu = 4.0 * rows * spec.dim / t if spec.projector_mlp else 0.0
    shuffle = 4.0 * rows * spec.projector_in if spec.config.pixel_shuffle > 1 else 0.0
    comm_f = comm_b = 0.0
    if spec.projector_mlp and t > 1:
        comm_f = collective_time("all_reduce", t, A * rows * spec.dim, links.tp)
        if vision:  # the features' gradient, summed over the ranks' linear_1 slices
            comm_b = collective_time("all_reduce", t, A * rows * spec.projector_in, links.tp)
    pf = sum(times) + acc.elementwise_time(gelu + shuffle)
    pb = pw = 0.0
    if vision or proj:
        pb = sum(times[1:]) + (times[0] if vision else 0.0) + acc.elementwise_time(2 * gelu)
    if proj:
        pw = sum(times)
    tp_f, tp_b = _exposed(comm_f, pf, rt.tp_overlap), _exposed(comm_b, pb, rt.tp_overlap)
    projector = Phase(f=pf + tp_f, b=pb + tp_b, w=pw, compute=pf + pb + pw, tp_comm=tp_f + tp_b)

    # the merge into the embeddings: masked scatter of the features (and their gradient
    # gathered back); under sp the embedding's all-reduce over whole sequences instead of
    # its reduce-scatter
    tokens = s.mbs * seq
    merge = acc.elementwise_time(4.0 * tokens * spec.dim + 2.0 * rows * spec.dim)
    merge_b = acc.elementwise_time(4.0 * rows * spec.dim) if (vision or proj) else 0.0
    sp_comm = 0.0
    if s.sp and t > 1:
        width = rt.param_bytes if rt.autocast_per_op else 2.0
        out = width * tokens * spec.dim
        sp_comm = collective_time("all_reduce", t, out, links.tp) - collective_time(
            "reduce_scatter", t, out, links.tp
        )
    merged = Phase(f=merge + sp_comm, b=merge_b, compute=merge + merge_b, tp_comm=sp_comm)
    return blocks + embed + projector + merged


def _zero3(
    spec: ModelSpec, s: Strategy, links: Links, rt: Runtime, one: Phase, vision: bool
) -> Phase:
    """ZeRO-3's gathers of the trainable encoder blocks (per block each way, in
    `Runtime.param_gather_bytes` per element) and, without unsharded accumulation, their
    gradients' reduce-scatters; frozen parameters stay whole (`models.freeze`)."""
    if s.zero != 3 or s.dcp <= 1 or not vision:
        return Phase()
    p = spec.vision_block_params(s.tp)
    gather = collective_time("all_gather", s.dcp, rt.param_gather_bytes * p, links.dp)
    f = _exposed(gather, one.f, rt.fsdp_overlap)
    b = _exposed(gather, one.b, rt.fsdp_overlap)
    if not rt.fsdp_unsharded_accumulation:
        rs = collective_time("reduce_scatter", s.dcp, rt.grad_reduce_bytes * p, links.dp)
        b += _exposed(rs, one.b, rt.fsdp_overlap)
    k = spec.vision_depth
    return Phase(f=k * f, b=k * b, dp_comm=k * (f + b))


def tower_memory(spec: ModelSpec, s: Strategy, rt: Runtime, fp8_saved: bool) -> TowerMemory:
    """The encoder's and projector's saved bytes per micro-batch (under the recompute
    policy), backward working set and W-pending bytes on one rank (module docstring)."""
    images = images_per_microbatch(spec, s)
    if not spec.vision or images <= 0:
        return TowerMemory()
    t, A = s.tp, rt.act_width  # noqa: N806 - bytes per activation element
    vision, proj = not spec.frozen("vision"), not spec.frozen("projector")
    d, depth = spec.vision_dim, spec.vision_depth
    matmuls = depth * spec.vision_block_matmul() / t
    matmuls += sum(g.n * g.k * g.count for g in projector_gemms(spec, images, t))
    fp8_weights = matmuls if s.fp8 else 0.0
    saved = working = w_pending = 0.0
    if vision:
        block = build_vision_block(spec, images, t, rt.autocast_per_op, rt.act_width)
        lm = LayerMemory.of(block, s.recompute, fp8_saved)
        x = images * spec.vision_positions * d
        pixels = A * images * 3 * spec.config.image_size**2  # the patch GEMM's input
        pre = (4.0 if rt.autocast_per_op else A) * x if spec.config.vision_pre_norm else 0.0
        saved = depth * saved_bytes(block, s.recompute, fp8_saved) + pixels + pre
        working = lm.working
        w_pending = depth * w_pending_bytes(block, fp8_saved) + pixels
    rows = images * spec.tokens_per_image
    width = spec.dim / t if spec.projector_mlp else spec.dim
    if proj:  # linear_1's and linear_2's inputs, for their weight gradients
        inputs = spec.projector_in + (width if spec.projector_mlp else 0.0)
        saved += A * rows * inputs
        grads_out = width + (spec.dim if spec.projector_mlp else 0.0)
        w_pending += A * rows * (inputs + grads_out)
    if (vision or proj) and spec.projector_mlp:  # the GELU's input
        saved += A * rows * width
    return TowerMemory(saved, working, w_pending, fp8_weights)
