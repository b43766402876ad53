"""The `[parallel]` section: the layout over ranks, and what each pipeline schedule needs.

`schedule_shape_problems` is the one home of the shapes (pipeline size, micro-batches,
chunks per rank) each schedule can be built for: the config's validation reports them and
the generators in `hyperloom.pipeline` raise them, with the same words.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob
from hyperloom.config.precision import _SCALE_BLOCK

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig

# The schedule kinds, in the order `hyperloom schedule --help` lists them.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe", "dualpipev")

# Stages per rank that a kind implies; interleaved is the one that takes vpp.
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "zb-v": 2, "dualpipe": 1, "dualpipev": 2}


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout. Their product must equal the world size."""

    dp: int = knob(1, "data-parallel degree")
    tp: int = knob(1, "tensor-parallel degree")
    pp: int = knob(1, "pipeline-parallel degree")
    cp: int = knob(1, "context-parallel degree: each rank holds 1/cp of every sequence")
    cp_comm: str = knob(
        "ring",
        "how attention crosses the context-parallel ranks: ring (K/V blocks passed around "
        "the cp group, overlapped with the next block's compute) or alltoall (Ulysses: "
        "heads <-> sequence; the heads per tp rank must divide by cp)",
        choices=["ring", "alltoall"],
    )
    ep: int = knob(1, "expert-parallel degree: each rank holds E / ep experts (folds over dp)")
    ep_dispatcher: str = knob(
        "alltoall",
        "how tokens reach their experts under ep: all-to-all of the routed rows, or "
        "all-gather of the group's rows + reduce-scatter of the outputs",
        choices=["alltoall", "allgather"],
    )
    ep_overlap: bool = knob(
        False,
        "overlap one micro-batch's expert-parallel all-to-alls with another's compute: "
        "DualPipe's F&B pairs, the forward-backward pairs of interleaved and zb-v steady "
        "states, and at pp = 1 micro-batch i's forward beside i-1's backward (grad_accum >= "
        "2) run as two alternating lanes (numbers unchanged)",
    )
    etp: int = knob(
        1,
        "expert tensor-parallel degree: each routed expert's hidden width split over "
        "consecutive runs of etp ranks inside each tp group (must divide tp; 1 = experts "
        "replicated over tp)",
    )
    sp: bool = knob(False, "sequence parallel: split norms/residuals along the sequence over tp")
    zero: int = knob(
        0,
        "0 = DDP; 1 = Adam state + master weights sharded over dp; 3 = FSDP2 (all sharded)",
        choices=[0, 1, 3],
    )
    # FSDP2's mixed precision (`parallel.data_parallel`). fp32 by default: the gathers then
    # carry the FP32 master weights and autocast casts per op, which keeps zero = 3 equal to
    # one process to FP32 rounding; bf16 halves the gathers but runs whole blocks, residual
    # stream included, in BF16, a change of numerics to opt into.
    fsdp_param_dtype: str = knob(
        "fp32",
        "zero = 3: dtype FSDP2 all-gathers the parameters in and computes with (bf16 halves "
        "the gathers; the sharded master weights and Adam state stay fp32)",
        choices=["fp32", "bf16"],
    )
    fsdp_reduce_dtype: str = knob(
        "fp32",
        "zero = 3: dtype of the gradients' reduce-scatter (and HSDP's all-reduce)",
        choices=["fp32", "bf16"],
    )
    dp_replicate: int = knob(
        1,
        "zero = 3: HSDP replica groups; each shards the parameters over dp / dp_replicate "
        "(x cp) ranks, and the groups all-reduce the sharded gradients (1 = plain FSDP2)",
    )
    order: str = knob("pp,dp,cp,tp", "rank order of the mesh, outermost first (tp innermost)")
    pp_schedule: str = knob(
        "1f1b",
        "pipeline schedule (`hyperloom schedule --help` describes each)",
        choices=PIPELINE_SCHEDULES,
    )
    vpp: int = knob(1, "model chunks per pipeline rank for 'interleaved' (zb-v/dualpipev imply 2)")
    microbatches: int = knob(
        0,
        "pipeline micro-batches per step, each train.micro_batch_size sequences (0 = 2 x pp)",
    )
    pp_layers: list[int] = knob(
        doc="layers per model chunk in pipeline order (empty = even split); a 0 gives the "
        "embedding or the head a chunk of its own",
        factory=list,
    )

    def invalid_degrees(self) -> list[str]:
        """Names of the degrees below 1 (the other checks need them all >= 1)."""
        degrees = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}
        degrees["etp"], degrees["dp_replicate"] = self.etp, self.dp_replicate
        return [k for k, v in degrees.items() if v < 1]

    def problems(self, job: JobConfig, world_size: int | None = None) -> list[str]:
        """The layout against the world size (default torchrun's WORLD_SIZE), the model's
        shapes and the pipeline schedule, arithmetic shown."""
        bad = self.invalid_degrees()
        if bad:
            return [f"parallel.{k} must be >= 1, got {getattr(self, k)}" for k in bad]
        if self.vpp < 1 or self.microbatches < 0:
            return [
                f"parallel.vpp ({self.vpp}) must be >= 1 and parallel.microbatches "
                f"({self.microbatches}) >= 0 (0 = 2 x pp)"
            ]
        p = _tensor_parallel_problems(job) + _pipeline_problems(job)
        p += _context_parallel_problems(job) + _overlap_problems(job)
        p += _expert_tensor_parallel_problems(job) + _fsdp_problems(job)
        world = world_size_from_env() if world_size is None else world_size
        dims = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp}
        product = self.dp * self.tp * self.pp * self.cp
        if product != world:
            expr = " * ".join(f"{k}({v})" for k, v in dims.items())
            p.append(f"{expr} = {product} != world size {world}")
        if (self.dp * self.cp) % self.ep:
            p.append(
                f"parallel.ep ({self.ep}) must divide dp x cp ({self.dp} x {self.cp}): experts "
                f"fold over the data- and context-parallel ranks"
            )
        return p


def world_size_from_env() -> int:
    """World size as torchrun announces it (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def pipeline_microbatches(par: ParallelConfig) -> int:
    """Micro-batches per pipelined step (the 0 default means 2 x pp, which every schedule
    accepts); 1 without pipeline parallelism."""
    if par.pp == 1:
        return 1
    return par.microbatches or 2 * par.pp


def pipeline_chunks(par: ParallelConfig) -> int:
    """Model chunks the layers are split into: pp x stages per rank (DualPipe's two copies
    of each chunk count once)."""
    if par.pp_schedule == "interleaved":
        return par.pp * par.vpp
    return par.pp * STAGES_PER_RANK.get(par.pp_schedule, 1)


def schedule_shape_problems(kind: str, pp: int, microbatches: int, vpp: int = 1) -> list[str]:
    """Why schedule `kind` cannot be built for pp ranks, `microbatches` and vpp chunks per
    rank: the first broken precondition (so at most one), empty when it can be built.

    The constraints are those of the published algorithms (the table in
    `hyperloom.pipeline.schedules`), stated with the numbers that break them.
    """
    m = microbatches
    if kind not in PIPELINE_SCHEDULES:
        return [f"unknown schedule {kind!r}; choose one of {', '.join(PIPELINE_SCHEDULES)}"]
    if pp < 1 or m < 1:
        return [f"{kind}: need pp >= 1 and micro-batches >= 1, got pp={pp}, m={m}"]
    if kind == "interleaved":
        if vpp < 2:
            return [
                f"interleaved needs --vpp >= 2 model chunks per rank, got {vpp} "
                f"(with one chunk per rank it is plain 1f1b)"
            ]
        if m % pp:
            lo = (m // pp) * pp
            near = f"{lo} or {lo + pp}" if lo else f"{pp}"
            return [
                f"interleaved (Megatron ordering) needs micro-batches to be a multiple of "
                f"pp={pp}: got {m}, try {near}"
            ]
        return []
    fixed = STAGES_PER_RANK[kind]
    if vpp not in (1, fixed):
        shape = "2 stages per rank (implied)" if fixed == 2 else "one stage per rank"
        hint = "; use 'interleaved' for more chunks per rank" if fixed == 1 else ""
        return [f"{kind} places {shape}: --vpp must be {fixed}, got {vpp}{hint}"]
    if kind == "zb-v" and pp < 2:
        return [f"zb-v needs pp >= 2 (the V turns at rank pp-1), got pp={pp}"]
    if kind == "dualpipe" and (pp < 2 or pp % 2 or m % 2 or m < 2 * pp):
        return [
            f"DualPipe needs an even pp >= 2 and an even number of micro-batches >= 2*pp; "
            f"got pp={pp}, m={m} (try pp={pp + pp % 2 if pp >= 2 else 2}, "
            f"m={max(2 * max(pp + pp % 2, 2), m + m % 2)})"
        ]
    if kind == "dualpipev" and m < 2 * pp:
        return [f"DualPipeV needs micro-batches >= 2*pp = {2 * pp}; got pp={pp}, m={m}"]
    return []


def _pipeline_problems(job: JobConfig) -> list[str]:
    par, t = job.parallel, job.train
    out = []
    if par.pp == 1:
        if par.microbatches > 1 or par.pp_layers:
            out.append(
                "parallel.microbatches and parallel.pp_layers need parallel.pp > 1 "
                "(use train.grad_accum to accumulate without a pipeline)"
            )
        return out
    shape = schedule_shape_problems(par.pp_schedule, par.pp, pipeline_microbatches(par), par.vpp)
    if shape:
        out.append(f"parallel.pp_schedule = '{par.pp_schedule}': {shape[0]}")
        return out
    chunks = pipeline_chunks(par)
    n_layers = job.model.n_layers
    if par.pp_layers:
        if len(par.pp_layers) != chunks or sum(par.pp_layers) != n_layers:
            out.append(
                f"parallel.pp_layers {par.pp_layers} must give {chunks} chunks "
                f"(pp({par.pp}) x stages per rank) that sum to model.n_layers ({n_layers}); "
                f"got {len(par.pp_layers)} chunks summing to {sum(par.pp_layers)}"
            )
        elif min(par.pp_layers) < 0:
            out.append(f"parallel.pp_layers must be >= 0 each, got {par.pp_layers}")
    elif n_layers < chunks:
        out.append(
            f"model.n_layers ({n_layers}) < {chunks} pipeline chunks: every chunk needs a "
            f"layer (or set parallel.pp_layers with explicit zeros)"
        )
    if par.zero == 3:
        out.append(
            "parallel.zero = 3 with parallel.pp > 1: FSDP under pipeline parallelism is not "
            "built yet; use zero 0 or 1"
        )
    if t.compile:
        out.append("train.compile with parallel.pp > 1 is not built yet; set train.compile false")
    return out


def _context_parallel_problems(job: JobConfig) -> list[str]:
    """The arithmetic context parallelism needs: each rank holds chunks i and 2cp-1-i of
    every sequence (the causal load balance), so the sequence splits into 2 x cp chunks,
    each further split over tp under sequence parallelism; all-to-all hands each rank
    heads / cp of the heads its tp rank holds."""
    m, par, cp = job.model, job.parallel, job.parallel.cp
    if cp == 1:
        return []
    out = []
    seq, parts = job.data.seq_len, 2 * cp * (par.tp if par.sp else 1)
    if seq % parts:
        what = f"2 x cp x tp = 2 x {cp} x {par.tp}" if par.sp and par.tp > 1 else "2 x cp"
        out.append(
            f"data.seq_len ({seq}) is not divisible by {what} = {parts}: context parallelism "
            f"splits each sequence into 2 x cp chunks (rank i holds chunks i and 2cp-1-i)"
            + (", each split over tp by sequence parallelism" if par.sp and par.tp > 1 else "")
        )
    if par.cp_comm == "alltoall":
        heads = m.n_heads // par.tp if m.n_heads % par.tp == 0 else m.n_heads / par.tp
        if heads % cp:
            out.append(
                f"parallel.cp_comm = 'alltoall' needs the query heads per tp rank "
                f"(model.n_heads / tp = {m.n_heads} / {par.tp} = {heads}) divisible by "
                f"parallel.cp ({cp}); use cp_comm = 'ring' or another cp"
            )
    elif m.dropout > 0:
        out.append(
            f"model.dropout = {m.dropout} with parallel.cp_comm = 'ring' is not supported: the "
            f"ring computes attention blockwise and applies no dropout to its weights; use "
            f"parallel.cp_comm = 'alltoall' or model.dropout = 0"
        )
    if job.train.compile:
        out.append(
            "train.compile with parallel.cp > 1 is not built yet (the attention's own "
            "collectives break the graph); set train.compile false"
        )
    return out


# Schedules whose steady state pairs a forward with a backward of another micro-batch without
# delaying a neighbour (`pipeline.schedules.pair_forward_backward`).
PAIRING_SCHEDULES = ("interleaved", "zb-v", "dualpipe", "dualpipev")


def _overlap_problems(job: JobConfig) -> list[str]:
    """What `parallel.ep_overlap` needs: all-to-alls to hide, pairs to hide them in, and no
    dropout under recompute (a recomputing lane sets the global RNG to the state it saved,
    and the other lane would draw its masks from it)."""
    par = job.parallel
    if not par.ep_overlap:
        return []
    out = []
    if par.ep == 1 or par.ep_dispatcher != "alltoall":
        out.append(
            f"parallel.ep_overlap hides the expert-parallel all-to-alls: it needs "
            f"parallel.ep > 1 and parallel.ep_dispatcher = 'alltoall' (got ep = {par.ep}, "
            f"ep_dispatcher = '{par.ep_dispatcher}')"
        )
    if par.pp == 1:  # gradient accumulation's pairs (`parallel.overlap_accum`)
        out += _accumulation_overlap_problems(job)
    elif par.pp_schedule not in PAIRING_SCHEDULES:
        out.append(
            f"parallel.ep_overlap runs pairs of one micro-batch's forward and another's "
            f"backward, which pp_schedule = '{par.pp_schedule}' cannot form without making "
            f"each pair wait for its neighbour's; use one of {', '.join(PAIRING_SCHEDULES)}"
        )
    if job.model.dropout > 0 and job.train.recompute != "none":
        out.append(
            f"parallel.ep_overlap with model.dropout = {job.model.dropout} and train.recompute "
            f"= '{job.train.recompute}' is not supported: a recomputing lane sets the shared "
            f"RNG to its saved state while the other lane draws masks; drop one of the three"
        )
    return out


def _accumulation_overlap_problems(job: JobConfig) -> list[str]:
    """`parallel.ep_overlap` at pp = 1 pairs micro-batch i's forward with micro-batch i-1's
    backward: it needs two micro-batches, and hooks that gather and free parameters per
    block (FSDP2) or compiled graphs would run interleaved across the two."""
    par, t, out = job.parallel, job.train, []
    if t.grad_accum < 2:
        out.append(
            f"parallel.ep_overlap at parallel.pp = 1 runs micro-batch i's forward beside "
            f"micro-batch i-1's backward: it needs train.grad_accum >= 2, got {t.grad_accum}"
        )
    if par.zero == 3:
        out.append(
            "parallel.ep_overlap at parallel.pp = 1 with parallel.zero = 3 is not supported: "
            "FSDP2 gathers a block's parameters in its forward and frees them after its "
            "backward, which two interleaved micro-batches would do to each other's blocks; "
            "use parallel.zero = 0 (DDP) or 1 (ZeRO-1)"
        )
    if t.compile:
        out.append(
            "parallel.ep_overlap with train.compile is not built yet (the lanes hand over "
            "between compiled graphs, untested); set train.compile false"
        )
    return out


def _expert_tensor_parallel_problems(job: JobConfig) -> list[str]:
    """etp > 1 (`hyperloom.parallel.expert_tensor_parallel`): a divisor of tp, an MoE model
    whose experts' hidden width splits into etp parts, and under a block FP8 recipe parts of
    whole scale blocks."""
    m, par, etp = job.model, job.parallel, job.parallel.etp
    if etp == 1:
        return []
    out = []
    if par.tp % etp:
        out.append(
            f"parallel.etp ({etp}) must divide parallel.tp ({par.tp}): the expert tensor-"
            f"parallel groups are consecutive runs of etp ranks inside each tp group"
        )
    if m.n_routed_experts <= 0:
        out.append(
            f"parallel.etp = {etp} splits routed experts: it needs a Mixture-of-Experts model "
            f"(model.n_routed_experts > 0)"
        )
    elif m.moe_ffn_dim % etp:
        out.append(
            f"model.moe_ffn_dim ({m.moe_ffn_dim}) is not divisible by parallel.etp ({etp}): "
            f"each expert tensor-parallel rank holds a whole share of every expert's hidden "
            f"width, {m.moe_ffn_dim} / {etp} = {m.moe_ffn_dim / etp:.4g}"
        )
    elif (m.moe_ffn_dim // etp) % _SCALE_BLOCK.get(job.precision.fp8, 1):
        block = _SCALE_BLOCK[job.precision.fp8]
        out.append(
            f"precision.fp8 = '{job.precision.fp8}' with parallel.etp = {etp}: each rank's "
            f"slice of model.moe_ffn_dim, {m.moe_ffn_dim} / {etp} = {m.moe_ffn_dim // etp}, "
            f"is not a multiple of the {block}-element scale block, so blocks would straddle "
            f"ranks; make model.moe_ffn_dim a multiple of {block * etp}"
        )
    return out


def _fsdp_problems(job: JobConfig) -> list[str]:
    """FSDP2's mixed precision and HSDP (`hyperloom.parallel.data_parallel`): zero = 3 only;
    BF16 gathers compute in BF16, which an FP32 job rules out; dp_replicate splits dp into
    replica groups that each shard over the rest of dp x cp."""
    par, out = job.parallel, []
    dtypes = ("fsdp_param_dtype", "fsdp_reduce_dtype")
    named = [f"parallel.{k} = '{getattr(par, k)}'" for k in dtypes if getattr(par, k) != "fp32"]
    if par.dp_replicate > 1:
        named.append(f"parallel.dp_replicate = {par.dp_replicate}")
    if named and par.zero != 3:
        return [
            f"{' and '.join(named)}: FSDP2 settings, which need parallel.zero = 3 (got zero = "
            f"{par.zero})"
        ]
    if par.fsdp_param_dtype == "bf16" and job.precision.dtype == "fp32":
        out.append(
            "parallel.fsdp_param_dtype = 'bf16' computes with BF16 parameters, which "
            "precision.dtype = 'fp32' rules out; set precision.dtype = 'bf16' or "
            "fsdp_param_dtype = 'fp32'"
        )
    r = par.dp_replicate
    if r == 1:
        return out
    if par.dp % r:
        out.append(
            f"parallel.dp_replicate ({r}) does not divide parallel.dp ({par.dp}): HSDP splits "
            f"dp into dp_replicate replica groups of equal size"
        )
    elif par.dp * par.cp == r:
        out.append(
            f"parallel.dp_replicate ({r}) = dp x cp ({par.dp} x {par.cp}) leaves each replica "
            f"one rank to shard over; use parallel.zero = 0 (DDP) or a smaller dp_replicate"
        )
    if par.ep > 1:
        out.append(
            f"parallel.dp_replicate = {r} with parallel.ep = {par.ep} is not supported: HSDP "
            f"of expert banks sharded over their expert-data-parallel group is not built yet; "
            f"use dp_replicate = 1 or ep = 1"
        )
    return out


def _tensor_parallel_problems(job: JobConfig) -> list[str]:
    m, par, tp = job.model, job.parallel, job.parallel.tp
    out = []
    for key in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        value = getattr(m, key)
        if value > 0 and value % tp:
            out.append(
                f"model.{key} ({value}) is not divisible by parallel.tp ({tp}): each tensor-"
                f"parallel rank needs a whole share, {value} / {tp} = {value / tp:.4g}"
            )
    if par.sp and tp > 1 and job.data.seq_len % tp:
        out.append(
            f"data.seq_len ({job.data.seq_len}) is not divisible by parallel.tp ({tp}); "
            f"sequence parallelism splits the sequence into tp equal parts"
        )
    if m.dropout > 0 and tp > 1:
        out.append(
            f"model.dropout = {m.dropout} with parallel.tp = {tp} is not supported: the "
            f"tensor-parallel ranks hold different slices (heads, sequence) of one tensor but "
            f"share one RNG stream, so their masks would repeat slice to slice (Megatron keeps "
            f"an RNG tracker for this); use model.dropout = 0 or parallel.tp = 1"
        )
    names = [n.strip() for n in par.order.split(",") if n.strip()]
    if sorted(names) != sorted(["pp", "dp", "cp", "tp"]):
        out.append(f"parallel.order must name pp, dp, cp and tp once each, got {par.order!r}")
    return out
