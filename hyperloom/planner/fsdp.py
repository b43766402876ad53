"""FSDP2 (ZeRO-3) per-layer costs: which groups a layer's parameters are gathered over, the
root module's gathers, and FSDP2's copies on the compute stream.

Split out of `costs.py`, which folds these into a layer's F/B (`costs.layer_phase`) and a
stage's first and last chunk (`simulate._layer`). The step's gradient reduction per ZeRO mode
stays in `costs.dp_sync`, beside the other modes'.

- Gathers (`zero3_gather_groups`): each layer's parameters are all-gathered at every forward
  and again in the backward, `Runtime.param_gather_bytes` per element (hyperloom's FSDP2
  gathers its FP32 parameters unless `parallel.fsdp_param_dtype` is bf16; Megatron gathers
  BF16), over dp x cp, or over one replica group under HSDP (`Strategy.dp_replicate`); at
  ep > 1 the local experts over the expert-data-parallel group.
- The root module (`root_gather_time`): the embedding, and the final norm with an untied
  head, gathered once per micro-batch forward before anything can run (exposed).
- Copies (`fsdp2_copy_time`): PyTorch's `_fully_shard` copies each gathered buffer out into
  the parameters, and the unsharded gradients into the reduce-scatter input, on the
  compute stream.
"""

from __future__ import annotations

from hyperloom.planner.collectives import Links, collective_time
from hyperloom.planner.hardware import HardwareProfile
from hyperloom.planner.model import ModelSpec
from hyperloom.planner.strategy import Runtime, Strategy


def zero3_gather_groups(spec: ModelSpec, s: Strategy) -> list[tuple[float, int, str]]:
    """(parameters, ranks, the `Links` field of their link) of each group one layer's FSDP2
    gathers run over, once per pass: the rank's tp share of the layer over dp x cp; at
    ep > 1 its local experts over the expert-data-parallel group instead; routed experts
    split over etp ranks, not tp."""
    t, e = s.tp, s.etp_size
    if s.dp_replicate > 1:  # HSDP (no experts): gathered over one replica group
        return [(spec.layer_params() / t, s.fsdp_shard, "shard")]
    if e == t:
        groups = [(spec.layer_params() / t, s.dcp, "dp")]
        if s.ep > 1:  # the local experts are gathered over the expert-data-parallel group
            expert = spec.layer_expert_params() / t
            groups = [((spec.layer_params() - expert * t) / t, s.dcp, "dp")]
            groups.append((expert / s.ep, s.edp, "edp"))
        return groups
    routed = spec.layer_expert_params()
    dense = (spec.layer_params() - routed) / t
    if s.ep > 1:
        return [(dense, s.dcp, "dp"), (routed / e / s.ep, s.edp, "edp")]
    return [(dense + routed / e, s.dcp, "dp")]


def root_gather_time(spec: ModelSpec, s: Strategy, rt: Runtime, links: Links, last: bool) -> float:
    """Seconds of FSDP2's gather of the root module's parameters on one chunk, once per
    micro-batch forward: the embedding (`last=False`) or the final norm and an untied head
    (`last=True`); 0 unless ZeRO-3 shards over several ranks."""
    if s.zero != 3 or s.dcp <= 1:
        return 0.0
    params = spec.embedding_params() / s.tp
    if last:
        params = spec.dim + (0.0 if spec.tie_embeddings else params)
    link = links.shard if links.shard is not None else links.dp
    return collective_time("all_gather", s.fsdp_shard, rt.param_gather_bytes * params, link)


def fsdp2_copy_time(
    gathered: float, s: Strategy, acc: HardwareProfile, rt: Runtime
) -> tuple[float, float]:
    """(forward, backward) seconds of FSDP2's copies on the compute stream for one layer and
    micro-batch, `gathered` the elements one gather brings (PyTorch's `_fully_shard`:
    `FSDPParamGroup.wait_for_unshard` runs `foreach_all_gather_copy_out` on the current
    stream, and `foreach_reduce` runs `foreach_reduce_scatter_copy_in` there before handing
    the reduce-scatter to its own stream). Each gather (forward, and backward's re-gather)
    copies the gathered buffer into the parameters (read and write at the gather width);
    each reduction copies the unsharded gradients (gather width) into the reduce-scatter
    input (reduce width), once per step under unsharded accumulation. The all-gather's
    copy-in runs on its own stream, hidden."""
    out = acc.memory_time(2.0 * rt.param_gather_bytes * gathered)
    rs_in = acc.memory_time((rt.param_gather_bytes + rt.grad_reduce_bytes) * gathered)
    per_mb = 1.0 / s.microbatches if rt.fsdp_unsharded_accumulation else 1.0
    return out, out + rs_in * per_mb


def zero3_layer_traffic(
    spec: ModelSpec, s: Strategy, acc: HardwareProfile, links: Links, rt: Runtime
) -> tuple[float, float, float, float]:
    """(gather, reduce-scatter, forward copies, backward copies) seconds of one layer and
    micro-batch under ZeRO-3, before any overlap: one pass's gathers (the forward's, and
    the backward's again), the per-micro-batch reduce-scatter of its gradients (0 under
    unsharded accumulation, which reduces once per step in `costs.dp_sync`) and
    `fsdp2_copy_time` when the runtime costs FSDP2's copies; zeros unless ZeRO-3 shards."""
    if s.zero != 3 or s.dcp <= 1:
        return 0.0, 0.0, 0.0, 0.0
    groups = [(p, n, getattr(links, lk)) for p, n, lk in zero3_gather_groups(spec, s)]
    copy_f = copy_b = 0.0
    if rt.fsdp2_copies:  # on the compute stream
        copy_f, copy_b = fsdp2_copy_time(sum(p for p, _, _ in groups), s, acc, rt)
    width = rt.param_gather_bytes
    gather = sum(collective_time("all_gather", n, width * p, lk) for p, n, lk in groups)
    rs = 0.0
    if not rt.fsdp_unsharded_accumulation:  # gradients reduce-scattered every micro-batch
        rs = sum(
            collective_time("reduce_scatter", n, rt.grad_reduce_bytes * p, lk)
            for p, n, lk in groups
        )
    return gather, rs, copy_f, copy_b
