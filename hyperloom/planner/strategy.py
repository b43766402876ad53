"""A parallel strategy (what the search varies) and a runtime (how the trainer behaves).

`Strategy` is one point of the search space (tp, pp, vpp, dp, cp and its attention
communication, ep, ZeRO, micro-batches, schedule, recompute, FP8; `Strategy.from_job`);
`check` says why a point cannot run, with the arithmetic. `Runtime` is what a strategy costs on
a given trainer: byte widths of parameters, gradients and optimizer state, and which
communication is overlapped and how well.

- ``hyperloom``: FP32 parameters under BF16 autocast, 16 B/param (zero 0, DDP overlapped with
  backward), 8 + 12/dp (our ZeRO-1, not overlapped; in-place all-reduces on gloo,
  ``zero1_in_place``), 16/dp (FSDP2, gradients unsharded under accumulation); +2 B/param of
  autocast weight copies while a micro-batch awaits backward; TP not overlapped; SP inputs
  saved gathered. `Runtime.from_job` also turns on per-op autocast saves
  (``autocast_per_op``) and the fused chunked cross-entropy, off in the built-in runtime so
  device numbers stay comparable with the published validation.
- ``megatron``: BF16 parameters with FP32 main gradients, 18, 6 + 12/dp, 18/dp B/param;
  gradient reduce and parameter gather overlapped; TP collectives 80% hidden (an assumption,
  docs/planner.md); SP inputs saved sharded and gathered again for wgrad.

Expert parallelism folds over dp x cp (`parallel/mesh.py`); dispatch is an all-to-all or an
all-gather pair, not overlapped behind the expert compute (``ep_overlap`` 0). With
``Strategy.ep_overlap`` (the job's `parallel.ep_overlap`) a forward and a backward of two
micro-batches run as one pair and ``ep_pair_hidden`` of the all-to-all time inside a pair
hides behind the other micro-batch's compute: for hyperloom the share
`benchmarks/ep_overlap.py` measured on CPU (gloo), for DeepSeek's system 1 (§3.2.1 calls
DualPipe's overlap full). ``a2a_node_dedup`` (DeepEP's once-per-node dispatch) and
``fp8_dispatch`` describe DeepSeek's own system and are set only where it is modelled.
``param_bytes=2`` models Megatron's memory layout with hyperloom's overlap.

Context parallelism (``Strategy.cp_comm``) is a ring of K/V blocks, each step's exchange
hidden behind that step's attention up to ``cp_overlap`` of it (0.85 on devices,
`RING_OVERLAP`; 0 on CPU where gloo computes on the same cores), or Ulysses' all-to-alls,
never hidden (`costs.context_comm`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hyperloom.config import PAIRING_SCHEDULES, JobConfig, pipeline_microbatches
from hyperloom.pipeline import SCHEDULES
from hyperloom.planner.errors import PlanError
from hyperloom.planner.model import ModelSpec, parse_recompute

ZERO_MODES = (0, 1, 3)
DISPATCHERS = ("alltoall", "allgather")
CP_COMMS = ("ring", "alltoall")  # the values of the job's parallel.cp_comm


# The share of a ring step's overlapped exchange that hides: 1 - the SMs overlapped
# communication takes from compute, taken as DeepSeek-V3's 20 of H800's 132 SMs dedicated to
# its overlapped all-to-all (arXiv 2412.19437 §3.2.2): 0.85. Assumed for every device; the
# per-step comparison of exchange and attention (what exceeds the step is exposed) is the
# model's, this factor is what it cannot see. Before: 1 (an exchange shorter than its step
# cost nothing).
RING_OVERLAP = 1.0 - 20.0 / 132.0


@dataclass(frozen=True)
class Runtime:
    """How a trainer stores state and overlaps communication (see module docstring)."""

    name: str
    param_bytes: int = 4  # bytes per parameter as stored (4 = FP32 master is the param)
    grad_bytes: int = 4  # bytes per gradient (FP32)
    zero1_separate_master: bool = True  # ZeRO-1 keeps its own FP32 master slice
    # gradients accumulate into one contiguous FP32 buffer (Megatron's main_grad), which the
    # distributed optimizer reduces and steps on without a flattened copy
    fp32_main_grads: bool = False
    fused_cross_entropy: bool = False  # chunked head + loss, grads formed in the forward
    # Megatron's `--cross-entropy-loss-fusion --cross-entropy-fusion-impl te`: TE's kernel
    # writes the loss gradient into the BF16 logits during the forward and keeps them, so the
    # head saves 2 B per logit and makes no FP32 copy (unfused: 4 B saved + 10 B transient)
    ce_in_place: bool = False
    # TransformerEngine under Megatron's gradient-accumulation fusion: the weight gradient goes
    # straight into main_grad and autograd gets a dummy BF16 tensor of the weight's shape,
    # cached for the run, one per distinct shape (`transformer_engine.pytorch.module.base.
    # get_dummy_wgrad`): 2 B per element of one of each of a layer's matrices, per rank
    te_dummy_wgrad: bool = False
    autocast_weight_copy: bool = True  # BF16 weight casts live while activations do
    autocast_per_op: bool = False  # FP32 norm in/out, a BF16 input cast per linear (job_runtime)
    ddp_bucket_copy: bool = False  # DDP buckets duplicate the gradients (no bucket views)
    # Gradients set to None after every step (`zero_grad(set_to_none=True)`): a single
    # micro-batch's activation peak holds only those formed in the forward (`memory.py`).
    grads_freed_each_step: bool = False
    fsdp_unsharded_accumulation: bool = True  # FSDP2 no_sync keeps unsharded grads
    sharded_save: bool = False  # SP: column-parallel inputs saved sharded (re-gathered)
    tp_overlap: float = 0.0  # fraction of TP comm hidden behind GEMMs
    # Ring attention: the fraction of each step's K/V (or dK/dV) exchange that hides behind
    # that step's attention compute; what exceeds the compute is exposed whatever this is
    # (`costs.context_comm`). Ulysses' all-to-alls are never hidden. Not 1: the exchange's
    # NCCL kernels run on SMs the attention then lacks, so the overlapped part still costs
    # their share of the step (`RING_OVERLAP`).
    cp_overlap: float = RING_OVERLAP
    ddp_overlap: float = 1.0  # zero 0: all-reduce behind the last backward
    zero1_overlap: float = 0.0  # zero 1: reduce-scatter / all-gather behind compute
    zero1_in_place: bool = False  # zero 1 all-reduces grads and weights instead (gloo)
    # ZeRO-1's step in bytes per element of the optimizer shard beyond a fused AdamW's 28
    # (``zero1_step_extra``) and per parameter (``zero1_publish_bytes``, copying the updated
    # weights out of the collective's buffer). hyperloom's `parallel/zero1.py` runs AdamW as
    # separate in-place ops (weight decay 8, lerp 12, mul + addcmul 20, sqrt/div/add 24,
    # addcdiv 16 = 80 B) and scales the clipped gradient shard (8 B); it publishes through
    # the gradient buffer (zeroed, 4 B/param, the slice copied in, 8 B per shard element, the
    # parameters copied out, 8 B/param). Megatron gathers into the parameters themselves.
    zero1_step_extra: float = 80.0 - 28.0 + 8.0 + 8.0
    zero1_publish_bytes: float = 12.0
    # Megatron's passes over the FP32 gradients around the reduction (`optimizer_time`):
    # each bucket is scaled in place by 1 / (dp x cp) before its collective when dp x cp > 1
    # (``param_and_grad_buffer.start_grad_sync``; 8 B per parameter, experts included), and
    # the optimizer multiplies its gradient shard by the clip coefficient (``clip_grads.
    # clip_grad_by_total_norm_fp32``; 8 B per shard element). Megatron scales only when the
    # norm exceeds ``--clip-grad``; charged every step, an assumption (early in a run it does).
    grad_prescale: bool = False
    clip_shard_bytes: float = 0.0
    fsdp_overlap: float = 1.0  # zero 3: per-block gathers behind compute
    # zero 3 is PyTorch FSDP2: its gathers' copy-out and reductions' copy-in run on the
    # compute stream (`fsdp.fsdp2_copy_time`); Megatron's FSDP gathers into its buffers
    fsdp2_copies: bool = True
    # zero 1 all-gathers the updated params in this width, zero 3 (FSDP2) each block's
    # params before use (`Runtime.from_job`: 2 under `parallel.fsdp_param_dtype = bf16`)
    param_gather_bytes: int = 4
    grad_reduce_bytes: int = 4
    # bytes per element of the activations sent between pipeline stages: FP32 in hyperloom's
    # executor (the residual stream of FP32 parameters under autocast), BF16 in Megatron's
    p2p_bytes: int = 4
    bucket_mb: float = 25.0  # the last gradient bucket is never hidden
    # a factor on every compute rate beyond the profile's own `step_eff` (1: the profile's
    # realistic rates; `--efficiency`)
    efficiency: float = 1.0
    ep_overlap: float = 0.0  # fraction of the EP all-to-all hidden behind expert compute
    ep_pair_hidden: float = 0.0  # ... hidden inside an overlapped F&B pair (see docstring)
    a2a_node_dedup: bool = False  # one network copy per destination node (DeepEP)
    fp8_dispatch: bool = False  # with FP8 on, the dispatch all-to-all moves FP8 (DeepSeek)
    # With FP8 on, each FP8 GEMM's input is saved for backward as its 1-byte FP8 copy, as TE's
    # per-tensor recipes and DeepSeek-V3 do; hyperloom's block recipes save the input itself
    # unless `precision.fp8_activation` (`Runtime.from_job` reads the job).
    fp8_saved_inputs: bool = True
    # Bytes per activation element: 2 under BF16 autocast; 4 when a job trains in FP32
    # (`precision.dtype = fp32`: no autocast, no weight casts).
    act_width: float = 2.0

    @property
    def norm_out_bytes(self) -> float:
        """Bytes per element of a norm's output, which the column-parallel linears take: FP32
        under autocast per op (the norm runs in FP32 and each linear casts its own copy),
        the activations' width otherwise."""
        return 4.0 if self.autocast_per_op else self.act_width

    def with_param_dtype(self, dtype: str) -> Runtime:
        """'bf16': BF16 params + FP32 master in the optimizer (Megatron's layout)."""
        if dtype == "bf16":
            return dataclasses.replace(
                self, param_bytes=2, autocast_weight_copy=False, param_gather_bytes=2
            )
        return dataclasses.replace(self, param_bytes=4)

    @classmethod
    def from_job(cls, job: JobConfig) -> Runtime:
        """The hyperloom runtime as this job runs it (`job_runtime`): the fused cross-entropy
        unless its ops keep the reference loss (vocab-parallel heads always run the chunked
        operator); FP8 layers save their inputs' FP8 copies under `precision.fp8_activation`,
        and per-tensor recipes (current, delayed) whenever their weight-gradient GEMM is FP8
        (`engine.fp8.modules`): with the forward and weight-gradient GEMMs both in high
        precision nothing is quantized to keep. A job trained in FP32 keeps FP32 activations.
        FSDP2's gathers and reductions move `parallel.fsdp_param_dtype` / `fsdp_reduce_dtype`
        (FP32 unless set; both need zero = 3)."""
        ops, p8 = job.ops, job.precision
        fused = (ops.fused and "cross_entropy" not in ops.reference) or job.parallel.tp > 1
        high = set(p8.fp8_high_precision)
        quantized = not {"fprop", "wgrad"} <= high
        per_tensor = p8.fp8 in ("current", "delayed") and "wgrad" not in high
        copies = quantized and (p8.fp8_activation or per_tensor)
        rt = job_runtime(fused_cross_entropy=fused, fp8_saved_inputs=copies)
        widths, par = {"fp32": 4, "bf16": 2}, job.parallel
        rt = dataclasses.replace(
            rt,
            param_gather_bytes=widths[par.fsdp_param_dtype],
            grad_reduce_bytes=widths[par.fsdp_reduce_dtype],
        )
        if p8.dtype == "fp32":  # no autocast: FP32 activations, no casts
            rt = dataclasses.replace(
                rt, act_width=4.0, autocast_per_op=False, autocast_weight_copy=False
            )
        return rt


def job_runtime(
    fused_cross_entropy: bool = True, base: str = "hyperloom", fp8_saved_inputs: bool = True
) -> Runtime:
    """The hyperloom runtime as a training job runs it (module docstring): the fused
    cross-entropy unless the job's ops keep the reference loss, autocast as torch applies
    it, per op (`autocast_per_op`), and whether FP8 layers save their inputs' FP8 copies."""
    return dataclasses.replace(
        RUNTIMES[base],
        fused_cross_entropy=fused_cross_entropy,
        autocast_per_op=True,
        fp8_saved_inputs=fp8_saved_inputs,
    )


# The share of a paired all-to-all's in-flight time that the other micro-batch's compute hid,
# measured by `benchmarks/ep_overlap.py` on 2 CPU cores with gloo (moe-tiny, seq 128): 62.2%
# (ep2 DualPipe), 62.9% (ep2 interleaved), 52.8% (ep4 DualPipe); their mean, rounded
# (benchmarks/results/ep_overlap.json). Not measured on GPUs.
HYPERLOOM_EP_PAIR_HIDDEN = 0.59

RUNTIMES = {
    "hyperloom": Runtime(
        "hyperloom", grads_freed_each_step=True, ep_pair_hidden=HYPERLOOM_EP_PAIR_HIDDEN
    ),
    "megatron": Runtime(
        "megatron",
        param_bytes=2,
        zero1_separate_master=True,
        fp32_main_grads=True,
        te_dummy_wgrad=True,
        autocast_weight_copy=False,
        fsdp_unsharded_accumulation=False,
        fsdp2_copies=False,
        sharded_save=True,
        tp_overlap=0.8,
        zero1_overlap=1.0,
        param_gather_bytes=2,
        p2p_bytes=2,
        zero1_step_extra=0.0,
        zero1_publish_bytes=0.0,
        grad_prescale=True,
        clip_shard_bytes=8.0,
    ),
}


@dataclass(frozen=True)
class Strategy:
    """One parallel layout and training recipe (a point of the search space)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1  # model chunks per rank (interleaved; V-shapes imply 2)
    zero: int = 0
    mbs: int = 1  # sequences per micro-batch per dp rank
    microbatches: int = 1  # micro-batches per step per dp rank
    schedule: str = "1f1b"
    recompute: str = "none"
    fp8: bool = False
    sp: bool = True  # sequence parallelism whenever tp > 1
    order: str = "pp,dp,cp,tp"
    dispatcher: str = "alltoall"  # EP token dispatch: "alltoall" or "allgather"
    cp_comm: str = "ring"  # CP attention: "ring" (K/V blocks passed round) or "alltoall" (Ulysses)
    ep_overlap: bool = False  # F&B pairs overlap their all-to-alls (parallel.ep_overlap)
    # Expert tensor parallelism (`parallel.etp`): the routed experts' hidden width split over
    # etp consecutive ranks of each tp group. 0: over the whole tp group (Megatron-Core's
    # default expert_tensor_parallel_size = tp, the planner's model before etp); 1: routed
    # experts replicated over tp (hyperloom's default). See `etp_size` and `costs.py`.
    etp: int = 0
    # HSDP (`parallel.dp_replicate`, zero = 3): dp x cp split into this many replica groups of
    # consecutive ranks; FSDP2 shards over each group (`fsdp_shard` ranks) and the groups
    # all-reduce their reduce-scattered gradients (`costs.dp_sync`)
    dp_replicate: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def dcp(self) -> int:
        """The ranks that hold the same parameters and sum their gradients: data x context
        parallel. Megatron's gradient reduction and distributed optimizer span both (context
        ranks see other tokens of the same sequences)."""
        return self.dp * self.cp

    @property
    def fsdp_shard(self) -> int:
        """Ranks ZeRO-3 shards parameters, gradients and optimizer state over: dp x cp, or
        one HSDP replica group of it (dp x cp / dp_replicate)."""
        return self.dcp // self.dp_replicate

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks holding the same experts (dp * cp / ep).
        At ep = 1 the experts are ordinary parameters of the dp group."""
        return self.dp * self.cp // self.ep if self.ep > 1 else self.dp

    @property
    def etp_size(self) -> int:
        """Ranks that split each routed expert's hidden width: `etp`, or tp when unset."""
        return self.etp or self.tp

    @property
    def global_batch(self) -> int:
        return self.dp * self.mbs * self.microbatches

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule in ("zb-v", "dualpipev") else self.vpp

    @property
    def model_chunks(self) -> int:
        """Distinct layer chunks the model is cut into (DualPipe's second copy is no cut)."""
        return self.pp if self.schedule == "dualpipe" else self.pp * self.stages_per_rank

    def label(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.stages_per_rank > 1:
            parts.append(f"v{self.stages_per_rank}")
        parts += [f"dp{self.dp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("a2a" if self.cp_comm == "alltoall" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + ("ag" if self.dispatcher == "allgather" else ""))
            if self.ep_overlap:
                parts.append("ovl")
        if self.etp and self.tp > 1:
            parts.append(f"etp{self.etp}")
        if self.dp_replicate > 1:
            parts.append(f"hsdp{self.dp_replicate}")
        parts += [f"z{self.zero}", f"mbs{self.mbs}x{self.microbatches}", self.schedule]
        parts.append(f"rc:{self.recompute}")
        if self.fp8:
            parts.append("fp8")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_job(
        cls,
        job: JobConfig,
        schedule: str | None = None,
        vpp: int | None = None,
        recompute: str | None = None,
        fp8: bool | None = None,
    ) -> Strategy:
        """The layout a training job runs: [parallel] and [train] read as `hyperloom train`
        reads them (a step is `microbatches x grad_accum` micro-batches per dp rank, the
        attention crosses the cp ranks by `parallel.cp_comm`, the routed experts split over
        `parallel.etp` ranks: 1 by default, replicated over tp; left unset, 0, for a model
        without routed experts); the schedule kind, chunks per rank, recompute policy and FP8
        from the job unless given."""
        par, tr = job.parallel, job.train
        if recompute is None:
            recompute = tr.recompute
            if tr.recompute_layers and recompute != "none":
                raise PlanError(
                    f"train.recompute_layers = {tr.recompute_layers}: the planner costs "
                    "recompute on every block of a chunk; plan with train.recompute_layers = 0"
                )
        kind = schedule or (par.pp_schedule if par.pp > 1 else "1f1b")
        chunks = vpp or (par.vpp if kind == "interleaved" else 1)
        return cls(
            tp=par.tp,
            pp=par.pp,
            dp=par.dp,
            cp=par.cp,
            cp_comm=par.cp_comm,
            ep=par.ep,
            dispatcher=par.ep_dispatcher,
            ep_overlap=par.ep_overlap,
            etp=par.etp if _routed_experts(job) else 0,
            zero=par.zero,
            dp_replicate=par.dp_replicate,
            sp=par.sp,
            order=par.order,
            mbs=tr.micro_batch_size,
            microbatches=pipeline_microbatches(par) * tr.grad_accum,
            schedule=kind,
            vpp=chunks,
            recompute=recompute,
            fp8=job.precision.fp8 != "none" if fp8 is None else fp8,
        )


def _routed_experts(job: JobConfig) -> bool:
    """Whether the job's model has routed experts (`ModelSpec.n_routed_experts`)."""
    family = getattr(job.model, "decoder_family", job.model.family)  # a vlm's decoder
    return family == "deepseek" and job.model.n_routed_experts > 0


def check(s: Strategy, spec: ModelSpec, seq: int, gpus: int | None = None) -> str | None:
    """Why `s` cannot run `spec` at sequence length `seq` (arithmetic shown), or None."""
    dims = {"tp": s.tp, "pp": s.pp, "dp": s.dp, "cp": s.cp, "ep": s.ep, "vpp": s.vpp}
    bad = [k for k, v in dims.items() if v < 1]
    if bad or s.mbs < 1 or s.microbatches < 1:
        return f"sizes must be >= 1: {dims}, mbs={s.mbs}, microbatches={s.microbatches}"
    if gpus is not None and s.world != gpus:
        return f"tp({s.tp}) * pp({s.pp}) * dp({s.dp}) * cp({s.cp}) = {s.world} != {gpus} GPUs"
    for name, value in (("n_heads", spec.n_heads), ("n_kv_heads", spec.n_kv_heads)):
        if value % s.tp:
            return f"{name} ({value}) is not divisible by tp ({s.tp})"
    if spec.ffn_dim % s.tp or spec.vocab_size % s.tp:
        return f"ffn_dim ({spec.ffn_dim}) and vocab ({spec.vocab_size}) must divide by tp ({s.tp})"
    if s.etp < 0:
        return f"etp must be >= 0 (0: the experts' width split over tp), got {s.etp}"
    if s.etp > 1 and not spec.n_routed_experts:
        return f"etp = {s.etp} splits routed experts: the dense family has no experts"
    if s.etp and s.tp % s.etp:
        return f"etp ({s.etp}) must divide tp ({s.tp})"
    if spec.moe_ffn_dim % s.etp_size:
        what = "etp" if s.etp else "tp"
        return f"moe_ffn_dim ({spec.moe_ffn_dim}) must divide by {what} ({s.etp_size})"
    shared = spec.n_shared_experts * spec.moe_ffn_dim  # the shared experts split over tp
    if shared % s.tp:
        return f"n_shared_experts * moe_ffn_dim ({shared}) must divide by tp ({s.tp})"
    if spec.vision:
        why = _vision_problem(s, spec, seq)
        if why:
            return why
    split = s.cp * 2 if s.cp > 1 else 1  # load-balanced CP cuts 2*cp chunks
    if seq % (split * (s.tp if s.sp and s.tp > 1 else 1)):
        return f"seq ({seq}) must divide by {'2*cp*' if s.cp > 1 else ''}tp = {split * s.tp}"
    if s.cp_comm not in CP_COMMS:
        return f"cp_comm must be one of {CP_COMMS}, got {s.cp_comm!r}"
    if s.cp > 1 and s.cp_comm == "alltoall" and (spec.n_heads // s.tp) % s.cp:
        return (
            f"cp_comm 'alltoall' needs the query heads per tp rank (n_heads / tp = "
            f"{spec.n_heads} / {s.tp} = {spec.n_heads // s.tp}) divisible by cp ({s.cp})"
        )
    if s.zero not in ZERO_MODES:
        return f"zero must be one of {ZERO_MODES}, got {s.zero}"
    r = s.dp_replicate
    if r < 1 or (r > 1 and (s.zero != 3 or s.dp % r or r == s.dcp or s.ep > 1)):
        return (
            f"dp_replicate ({r}) must be >= 1; HSDP needs zero = 3 (got {s.zero}), "
            f"dp_replicate dividing dp ({s.dp}) and below dp x cp ({s.dcp}), and ep = 1 "
            f"(got {s.ep})"
        )
    if s.schedule not in SCHEDULES:
        return f"unknown schedule {s.schedule!r}; choose one of {', '.join(SCHEDULES)}"
    m, p = s.microbatches, s.pp
    if s.schedule == "interleaved" and (s.vpp < 2 or m % p):
        return f"interleaved needs vpp >= 2 ({s.vpp}) and microbatches ({m}) % pp ({p}) == 0"
    if s.schedule != "interleaved" and s.vpp != 1:
        return f"{s.schedule} fixes its chunks per rank; vpp must be 1, got {s.vpp}"
    if s.schedule == "dualpipe" and (p % 2 or m % 2 or m < 2 * p):
        return f"dualpipe needs even pp ({p}) and even microbatches ({m}) >= 2*pp"
    if s.schedule == "dualpipev" and m < 2 * p:
        return f"dualpipev needs microbatches ({m}) >= 2*pp = {2 * p}"
    if s.ep_overlap and (why := _overlap_problem(s)):
        return why
    if s.ep > 1:
        if not spec.n_routed_experts:
            return f"ep = {s.ep}: the dense family has no experts"
        if (s.dp * s.cp) % s.ep:
            return f"ep ({s.ep}) must divide dp({s.dp}) * cp({s.cp}) = {s.dp * s.cp}"
        if spec.n_routed_experts % s.ep:
            return f"ep ({s.ep}) must divide n_routed_experts ({spec.n_routed_experts})"
    if s.dispatcher not in DISPATCHERS:
        return f"dispatcher must be one of {DISPATCHERS}, got {s.dispatcher!r}"
    if s.model_chunks > spec.n_layers:
        return (
            f"pp({s.pp}) * chunks per rank({s.stages_per_rank}) = {s.model_chunks} chunks "
            f"> {spec.n_layers} layers"
        )
    if s.pp == 1 and s.schedule not in ("1f1b", "gpipe"):
        return f"{s.schedule} needs pp > 1"
    try:
        parse_recompute(s.recompute)
    except ValueError as exc:
        return str(exc)
    return None


def _overlap_problem(s: Strategy) -> str | None:
    """What `ep_overlap` needs: all-to-alls, and pairs to run them in -- a pairing schedule at
    pp > 1, or at pp = 1 gradient accumulation's (F_i, B_{i-1}) pairs
    (`parallel.overlap_accum`: two micro-batches or more, not under FSDP2)."""
    if s.ep == 1 or s.dispatcher != "alltoall":
        return (
            f"ep_overlap needs ep > 1 with the alltoall dispatcher (got ep {s.ep}, {s.dispatcher})"
        )
    if s.pp == 1 and (s.microbatches < 2 or s.zero == 3):
        return (
            f"ep_overlap at pp = 1 pairs micro-batch i's forward with i-1's backward: it needs "
            f"2 or more micro-batches and zero != 3 (got {s.microbatches}, zero {s.zero})"
        )
    if s.pp > 1 and s.schedule not in PAIRING_SCHEDULES:
        return (
            f"ep_overlap at pp > 1 needs one of {', '.join(PAIRING_SCHEDULES)} (got {s.schedule})"
        )
    return None


def _vision_problem(s: Strategy, spec: ModelSpec, seq: int) -> str | None:
    """What a vlm's encoder and projector cannot run (`config.models.vlm.vlm_problems`)."""
    if s.cp > 1:
        return f"cp = {s.cp}: a vlm runs without context parallelism (images straddle chunks)"
    for name, width in (
        ("vision_heads", spec.vision_heads),
        ("vision_ffn_dim", spec.vision_ffn_dim),
    ):
        if width % s.tp:
            return f"{name} ({width}) is not divisible by tp ({s.tp})"
    images = spec.images_per_sample * spec.tokens_per_image
    if images > seq:
        return (
            f"{spec.images_per_sample:g} image(s) x {spec.tokens_per_image} tokens = "
            f"{images:g} > seq ({seq})"
        )
    return None
