"""The planner checks itself in every training run.

`hyperloom train` ends by asking the planner what this very job (model, layout, schedule,
micro-batches) should have cost on this machine, and prints the answer beside what it
measured: the mean seconds per optimizer step of the training steps (evaluation and
checkpoints excluded) and the peak memory of the busiest rank above what it held before the
model was built (the runtime, the data and the interpreter are not the planner's to
predict). Both go to `summary.json` with their relative errors, so every run is one more
validation point of the cost model, not a separate experiment.

The prediction is only as good as the hardware numbers. `logging.self_check` names them:

- ``auto`` (default): a profile this machine measured, cached per (device kind, dtype, world
  size) under the hyperloom cache; measured once, quickly (`calibrate(quick=True)`), on first
  use. Collectives are measured only when the job has more than one rank.
- a path: a profile JSON written by ``hyperloom plan calibrate --out FILE``.
- ``off``: no prediction.

On CPU the calibrated profile is the whole machine (all cores) while a rank of a job gets
`min(its threads, cores / ranks)` of them; `compute_share` scales the profile's compute and
memory rates by that share. What the check does not model: other processes sharing the cores
(see benchmarks/README.md); the planner costs one pipeline flush of
`microbatches x grad_accum` micro-batches where the trainer runs `grad_accum` flushes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from hyperloom.config import JobConfig, pipeline_microbatches
from hyperloom.planner.errors import PlanError
from hyperloom.planner.hardware import GIB, Accelerator, Cluster, load_profile, save_profile
from hyperloom.planner.model import ModelSpec
from hyperloom.planner.strategy import Runtime, Strategy, job_runtime

log = logging.getLogger("hyperloom.planner")


def job_strategy(
    job: JobConfig,
    schedule: str | None = None,
    vpp: int | None = None,
    recompute: str = "none",
    fp8: bool | None = None,
) -> Strategy:
    """The planner's `Strategy` for a training job (schedule, vpp and fp8 from the job unless
    given)."""
    par, tr = job.parallel, job.train
    kind = schedule or (par.pp_schedule if par.pp > 1 else "1f1b")
    chunks = vpp or (par.vpp if kind == "interleaved" else 1)
    return Strategy(
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        cp=par.cp,
        ep=par.ep,
        dispatcher=getattr(par, "ep_dispatcher", "alltoall"),
        zero=par.zero,
        sp=par.sp,
        order=par.order,
        mbs=tr.micro_batch_size,
        microbatches=pipeline_microbatches(par) * tr.grad_accum,
        schedule=kind,
        vpp=chunks,
        recompute=recompute,
        fp8=job.precision.fp8 != "none" if fp8 is None else fp8,
    )


def runtime_of(job: JobConfig) -> Runtime:
    """The planner's runtime for this job: the fused cross-entropy unless its ops keep the
    reference loss (vocab-parallel heads always run the chunked operator); FP8 layers save
    their inputs' FP8 copies under `precision.fp8_activation`, and per-tensor recipes
    (current, delayed) whenever their weight-gradient GEMM is FP8 (`engine.fp8.modules`):
    with the forward and weight-gradient GEMMs both in high precision nothing is quantized
    to keep."""
    ops, p8 = job.ops, job.precision
    fused = (ops.fused and "cross_entropy" not in ops.reference) or job.parallel.tp > 1
    high = set(p8.fp8_high_precision)
    quantized = not {"fprop", "wgrad"} <= high
    per_tensor = p8.fp8 in ("current", "delayed") and "wgrad" not in high
    copies = quantized and (p8.fp8_activation or per_tensor)
    return job_runtime(fused_cross_entropy=fused, fp8_saved_inputs=copies)


CPU_PROFILE = "calibrated-cpu"  # what `calibrate` names a profile measured on a CPU


def cpu_runtime(rt: Runtime) -> Runtime:
    """The runtime on CPU ranks: gloo copies and reduces on the cores the compute needs, so
    a collective issued "in the background" (DDP's buckets during the backward, FSDP's
    prefetches) takes its time from the compute instead of hiding behind it; and ZeRO-1 on
    gloo all-reduces in place (`parallel/zero1.py`)."""
    return dataclasses.replace(
        rt,
        ddp_overlap=0.0,
        fsdp_overlap=0.0,
        cp_overlap=0.0,
        zero1_overlap=0.0,
        ep_overlap=0.0,
        zero1_in_place=True,
    )


def cached_profile(
    cache: Path, kind: str, dtype: str, world: int, host_allocator: str = "cache"
) -> Accelerator:
    """This machine's measured profile for (device kind, dtype, world and, on CPU, the host
    allocator policy); measured if absent."""
    # v10: resident memory as a fixed part plus a share of each step's churn; v9: the cast
    # rate (cast_eff); v8: CPU profiles measured with all cores also inside a
    # rank (v6-v7 measured one thread there and then took a rank's share of it again);
    # v7: the wait of CPU collectives between computing ranks (collective_wait_us);
    # v6: GEMMs in interleaved rounds, the per-layer overhead from each model's fastest step;
    # v5: the per-layer host overhead; v4: kernels timed in their training form, elementwise
    # and attention tables; v3: CPU profiles measured under the run's host allocator policy
    policy = f"-{host_allocator}" if kind == "cpu" else ""
    path = cache / "planner" / f"calibrated-{kind}-{dtype}-w{world}{policy}-v10.json"
    if path.exists():
        return load_profile(path)
    from hyperloom.planner.calibrate import calibrate

    log.info("calibrating the planner on this machine once (cached in %s)", path)
    profile, raw = calibrate(
        kind,
        dtype,
        quick=True,
        collectives=world > 1,
        host_allocator=host_allocator,
        progress=lambda text: log.info("calibrating: %s", text),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path, {"measurements": raw})
    return profile


def cpu_share(threads_per_rank: int, ranks_here: int, cores: int | None = None) -> float:
    """Share of a CPU profile (measured with every core) one rank of a job can use while it
    computes: its own threads' worth, at most an even split of the cores. When the ranks'
    threads outnumber the cores, `oversubscribed_step` adds the cores' total capacity as a
    second bound."""
    cores = cores or os.cpu_count() or 1
    return min(threads_per_rank, cores) / cores


def oversubscribed_step(plan, ranks_here: int, demand_share: float) -> float:
    """The step time when the `ranks_here` CPU ranks of this machine each want `demand_share`
    of it while they are busy and together want more than all of it: the simulated step
    (each rank at full speed while it runs) or the machine's total work divided by its
    capacity, whichever is longer. A pipeline rank's idle bubble is where another rank's work
    runs -- the reason a fixed per-rank share (cores / ranks) overestimated pp2 x dp2 on two
    cores by 40%.

    Work of a pipeline rank: its compute, communication (loopback collectives copy on the
    CPU, exposed or not) and optimizer step; each pipeline rank stands for ranks_here / pp
    ranks of this machine (its tp, cp and dp peers)."""
    kinds = ("compute", "recompute", "tp_comm", "cp_comm", "zero3_gather", "ep_comm")
    kinds += ("dp_sync_total", "optimizer")
    busy = sum(sum(part.get(k, 0.0) for k in kinds) for part in plan.rank_breakdown)
    return max(plan.step_time, busy * ranks_here / plan.strategy.pp * demand_share)


def self_check(
    job: JobConfig,
    profile: Accelerator,
    world: int,
    measured_step_s: float | None,
    measured_peak_bytes: float | None,
    compute_share: float = 1.0,
    ranks_here: int = 1,
) -> dict[str, Any]:
    """Predicted vs measured step time and peak memory, flat keys for summary.json.
    `compute_share` is one rank's share of the profile's machine (`cpu_share`); when the
    `ranks_here` ranks of this machine want more than all of it, `oversubscribed_step`."""
    from hyperloom.planner.simulate import predict

    if compute_share != 1.0:
        profile = dataclasses.replace(
            profile,
            bf16_tflops=profile.bf16_tflops * compute_share,
            hbm_gbs=profile.hbm_gbs * compute_share,
        )

    spec = ModelSpec.from_model_config(job.model, job.model.preset)
    strategy = job_strategy(job)
    cluster = Cluster(profile, world, gpus_per_node=world)
    try:
        rt = runtime_of(job)
        if profile.name == CPU_PROFILE:
            rt = cpu_runtime(rt)
        plan = predict(spec, cluster, strategy, job.data.seq_len, rt, margin_gib=0.0)
    except PlanError as exc:
        return {"plan_error": str(exc)}
    step = plan.step_time
    if ranks_here * compute_share > 1.0 + 1e-9:
        step = oversubscribed_step(plan, ranks_here, compute_share)
    out: dict[str, Any] = {
        "plan_profile": profile.name,
        "plan_compute_share": compute_share,
        "plan_ranks_here": ranks_here,
        "predicted_step_s": step,
        "measured_step_s": measured_step_s,
        "predicted_peak_memory_gb": plan.peak_memory / 1e9,
        "predicted_live_memory_gb": max(m.live for m in plan.memory) / 1e9,
        "plan_host_alloc_factor": profile.host_alloc_factor,
        "plan_host_runtime_gb": profile.host_runtime_bytes / 1e9,
        "plan_host_churn_factor": profile.host_churn_factor,
        "measured_peak_memory_gb": None
        if measured_peak_bytes is None
        else measured_peak_bytes / 1e9,
    }
    if measured_step_s:
        out["step_time_error"] = step / measured_step_s - 1
    if measured_peak_bytes:
        out["memory_error"] = plan.peak_memory / measured_peak_bytes - 1
    # the rank whose peak is compared (a pipeline's busiest stage, not necessarily rank 0)
    busiest = max(plan.memory, key=lambda m: m.peak)
    out["predicted_memory_rank"] = plan.memory.index(busiest)
    out["predicted_memory_gib_by_part"] = {
        k: round(v / GIB, 4) for k, v in busiest.to_dict().items()
    }
    return out
