"""The planner's prediction for a training job, beside what the job measured.

`hyperloom train` ends by handing the planner its measured step time and peak memory (above
the pre-model baseline); `self_check` returns prediction and measurement with their relative
errors for summary.json, so every run validates the cost model. The hardware numbers come
from `logging.self_check` (``auto``: this machine's cached profile; a JSON; or ``off``). A CPU
profile is the whole machine, shared among ranks (`cpu_share`, `oversubscribed_step`). Not
modelled: other processes on the cores, and the trainer's `grad_accum` pipeline flushes (the
planner costs one flush of `microbatches x grad_accum`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperloom.config import JobConfig
from hyperloom.planner.errors import PlanError
from hyperloom.planner.hardware import GIB, Cluster, HardwareProfile, load_profile, save_profile
from hyperloom.planner.host_memory import RuntimeMemoryProbe
from hyperloom.planner.model import ModelSpec
from hyperloom.planner.strategy import Runtime, Strategy

if TYPE_CHECKING:
    from hyperloom.planner.simulate import Plan

log = logging.getLogger("hyperloom.planner")


CPU_PROFILE = "calibrated-cpu"  # what `calibrate` names a profile measured on a CPU


def cpu_runtime(rt: Runtime) -> Runtime:
    """The runtime on CPU ranks: gloo copies and reduces on the cores the compute needs, so
    a collective issued "in the background" (DDP's buckets during the backward, FSDP's
    prefetches, ring attention's K/V exchanges) takes its time from the compute instead of
    hiding behind it; and ZeRO-1 on
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


def profile_path(cache: Path, kind: str, dtype: str, world: int, host_allocator: str) -> Path:
    """Where `cached_profile` keeps the profile of (device kind, dtype, world, allocator)."""
    # the suffix is the profile's format: raise it when calibration measures something new
    policy = f"-{host_allocator}" if kind == "cpu" else ""
    return cache / "planner" / f"calibrated-{kind}-{dtype}-w{world}{policy}-v11.json"


def cached_profile(
    cache: Path,
    kind: str,
    dtype: str,
    world: int,
    host_allocator: str = "cache",
    runtime_memory: RuntimeMemoryProbe | None = None,
    isolate: bool = False,
) -> HardwareProfile:
    """This machine's measured profile for (device kind, dtype, world and, on CPU, the host
    allocator policy); measured if absent, with `runtime_memory` the trainer's probe for the
    host-memory fit (`calibrate`). `isolate` measures in a child process, so that a trainer
    that has not built its model yet holds none of the calibration's memory or kernels (its
    memory baseline and peak stay those of a run that found the cache)."""
    path = profile_path(cache, kind, dtype, world, host_allocator)
    if path.exists():
        return load_profile(path)
    if isolate:
        import multiprocessing

        log.info("calibrating the planner once, in a separate process (cached in %s)", path)
        args = (cache, kind, dtype, world, host_allocator, runtime_memory)
        child = multiprocessing.get_context("spawn").Process(target=_calibrate_child, args=args)
        child.start()
        child.join()
        if child.exitcode or not path.exists():
            raise OSError(f"planner calibration failed in its process (exit {child.exitcode})")
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
        runtime_memory=runtime_memory,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path, {"measurements": raw})
    return profile


def _calibrate_child(*args) -> None:
    """`cached_profile` in a spawned process, its progress on stderr."""
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    cached_profile(*args)


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
    runs, which a fixed per-rank share (cores / ranks) would leave out.

    Work of a pipeline rank: its compute, communication (loopback collectives copy on the
    CPU, exposed or not) and optimizer step; each pipeline rank stands for ranks_here / pp
    ranks of this machine (its tp, cp and dp peers)."""
    kinds = ("compute", "recompute", "tp_comm", "cp_comm", "zero3_gather", "ep_comm")
    kinds += ("dp_sync_total", "optimizer")
    busy = sum(sum(part.get(k, 0.0) for k in kinds) for part in plan.rank_breakdown)
    return max(plan.step_time, busy * ranks_here / plan.strategy.pp * demand_share)


def job_plan(
    job: JobConfig,
    profile: HardwareProfile,
    world: int,
    compute_share: float = 1.0,
    recompute: str | None = None,
) -> Plan:
    """The planner's prediction for the job as `hyperloom train` runs it on `world` ranks of
    one machine described by `profile` (a rank getting `compute_share` of it), under the
    job's recompute policy or `recompute`; PlanError if it cannot run."""
    from hyperloom.planner.simulate import predict

    if compute_share != 1.0:
        profile = dataclasses.replace(
            profile,
            bf16_tflops=profile.bf16_tflops * compute_share,
            hbm_gbs=profile.hbm_gbs * compute_share,
        )
    spec = ModelSpec.from_job(job)
    strategy = Strategy.from_job(job, recompute=recompute)
    cluster = Cluster(profile, world, gpus_per_node=world)
    rt = Runtime.from_job(job)
    if profile.name == CPU_PROFILE:
        rt = cpu_runtime(rt)
    return predict(spec, cluster, strategy, job.data.seq_len, rt, margin_gib=0.0)


def self_check(
    job: JobConfig,
    profile: HardwareProfile,
    world: int,
    measured_step_s: float | None,
    measured_peak_bytes: float | None,
    compute_share: float = 1.0,
    ranks_here: int = 1,
) -> dict[str, Any]:
    """Predicted vs measured step time and peak memory, flat keys for summary.json.
    `compute_share` is one rank's share of the profile's machine (`cpu_share`); when the
    `ranks_here` ranks of this machine want more than all of it, `oversubscribed_step`."""
    try:
        plan = job_plan(job, profile, world, compute_share)
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
