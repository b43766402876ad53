"""`plan calibrate --job CONFIG`: time the job's own GEMM shapes and fit the GEMM model.

A GEMM's efficiency depends on its shape (`kernels.GemmModel`), so the measurements that
matter are those of the shapes the job will run: each linear of one layer (and the output
head) on one rank, in its three training forms -- forward (m x k) @ (k x n), data gradient
(m x n) @ (n x k), weight gradient (n x m) @ (m x k) -- as `model.build_layer` lays them out
for the job's tp, cp, sp, ep and micro-batch. Each form is timed as a plain matmul (the median
of a few calls after warm-up) and stored in the profile's ``gemm_table`` under its own shape,
where `HardwareProfile.gemm_efficiency` finds it. On a device with an SM count
(``multi_processor_count``) the model's ``peak_eff`` and ``k_half`` are refitted to every
measured form (`kernels.fit_gemm_model`), so shapes the job does not run are predicted from
this device too. A CPU has no SM waves: its profile keeps the nearest-shape table alone.
"""

from __future__ import annotations

import dataclasses

import torch

from hyperloom.planner.hardware import HardwareProfile
from hyperloom.planner.kernels import GemmModel, fit_gemm_model
from hyperloom.planner.kernels import gemm_forms as kernel_forms
from hyperloom.planner.model import ModelSpec, build_layer
from hyperloom.planner.strategy import Runtime, Strategy

Shape = tuple[int, int, int]


def gemm_forms(m: float, n: float, k: float) -> list[Shape]:
    """A linear's three training GEMMs (`kernels.gemm_forms`) in whole rows and columns."""
    return [tuple(max(1, round(v)) for v in form) for form in kernel_forms(m, n, k)]


def job_gemm_shapes(job) -> list[Shape]:
    """Every GEMM form one rank runs for the job's layer and output head (module docstring),
    without repeats, in first-seen order."""
    spec = ModelSpec.from_job(job)
    s = Strategy.from_job(job)
    rt = Runtime.from_job(job)
    layer = build_layer(
        spec, s.mbs, job.data.seq_len, s.tp, s.cp, s.sp, rt.sharded_save, s.ep,
        rt.autocast_per_op, rt.act_width, etp=s.etp,
    )  # fmt: skip
    tokens = s.mbs * job.data.seq_len / s.cp
    shapes = [f for g in layer.gemms for f in gemm_forms(g.m, g.n, g.k)]
    shapes += gemm_forms(tokens, spec.vocab_size / s.tp, spec.dim)
    return list(dict.fromkeys(shapes))


def measure_matmuls(acc, dtype: torch.dtype, shapes: list[Shape], runs: int = 5):
    """TFLOP/s of (m x k) @ (k x n) for each (m, n, k) in `shapes`, as [(shape, tflops)]: the
    median of `runs` calls after warm-up (`calibrate._median_time`)."""
    from hyperloom.planner.calibrate import _median_time

    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=acc.device).to(dtype)
        b = torch.randn(k, n, device=acc.device).to(dtype)
        seconds = _median_time(lambda a=a, b=b: a @ b, acc.synchronize, runs)
        out.append(((m, n, k), 2.0 * m * n * k / seconds / 1e12))
    return out


def device_sms(acc) -> int:
    """Streaming multiprocessors (compute units) of the device, 0 on CPU or when unknown."""
    if acc.kind == "cpu":
        return 0
    props = getattr(torch, acc.kind).get_device_properties(acc.index)
    return int(getattr(props, "multi_processor_count", 0) or 0)


def with_job_gemms(
    profile: HardwareProfile, measured: list[tuple[Shape, float]], sms: int
) -> HardwareProfile:
    """`profile` with `measured` (shape, TFLOP/s) in its table, relative to its BF16 peak
    (raised to the fastest measurement), and, given an SM count, the GEMM model fitted to
    them."""
    peak = max([profile.bf16_tflops, *(t for _, t in measured)])
    old = {s: e * profile.bf16_tflops / peak for s, e in profile.gemm_table}
    old.update({s: t / peak for s, t in measured})
    table = tuple(old.items())
    model = None
    if sms > 0:
        samples = [(s, t / peak) for s, t in measured]
        model = fit_gemm_model(GemmModel(sms, 1.0, source="plan calibrate"), samples)
    return dataclasses.replace(profile, bf16_tflops=peak, gemm_table=table, gemm_model=model)
