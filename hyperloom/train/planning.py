"""The trainer's questions to the planner: this machine's profile, `train.recompute = auto`,
and the self-check that puts the planner's step time and memory beside the measured ones.

Kept apart from the loop (trainer.py) because each call reaches into the planner, which the
trainer otherwise never needs; the planner itself never imports the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hyperloom.config import ConfigError

if TYPE_CHECKING:
    from hyperloom.train.trainer import Trainer

log = logging.getLogger("hyperloom.train")


def plan_profile(trainer: Trainer, before_model: bool = False):
    """(hardware profile, this rank's share of it, ranks on this machine) for the planner:
    `logging.self_check`'s JSON, or this machine's profile, calibrated once and cached.
    `before_model` (recompute auto): a calibration runs in its own process, and with
    self_check off the profile is an uncalibrated one of this device's memory (auto
    still needs the planner's memory model)."""
    from hyperloom.data.build import cache_root
    from hyperloom.planner.hardware import HardwareProfile, load_profile
    from hyperloom.planner.selfcheck import CPU_PROFILE, cached_profile, cpu_share
    from hyperloom.train.probe import measure_runtime_memory

    cfg, world = trainer.cfg, trainer.mesh.world_size
    choice = cfg.logging.self_check
    if choice == "off" and before_model:
        gib = trainer.acc.memory_capacity_bytes() / 2**30
        profile = HardwareProfile(f"uncalibrated-{trainer.acc.kind}", 1.0, 0.0, gib, 100.0, 1.0)
        return profile, 1.0, 1
    if choice == "auto":  # calibrates once; the trainer measures the host memory fit
        root = cache_root(cfg.data)
        kind, dtype, policy = trainer.acc.kind, cfg.precision.dtype, cfg.train.host_allocator
        profile = cached_profile(
            root, kind, dtype, world, policy, measure_runtime_memory, isolate=before_model
        )
    else:
        profile = load_profile(choice)
    share, local = 1.0, 1
    if profile.name == CPU_PROFILE:  # all cores measured; a rank gets a share
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        share = cpu_share(torch.get_num_threads(), local)
    return profile, share, local


def choose_recompute(trainer: Trainer):
    """`train.recompute = auto`: the main rank asks the planner for each stage's policy
    (planner.autorecompute) and tells the others; a budget nothing fits is a ConfigError
    on every rank."""
    from hyperloom.planner import PlanError
    from hyperloom.planner.autorecompute import for_job
    from hyperloom.planner.simulate import DEFAULT_MARGIN_GIB

    box: list[Any] = [None]
    if trainer.mesh.is_main:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        budget = trainer.cfg.train.memory_budget_gb * 1e9
        if not budget:  # the device's capacity less the planner's margin, or 10%
            capacity = trainer.acc.memory_capacity_bytes() / (
                local if trainer.acc.kind == "cpu" else 1
            )
            budget = capacity - min(DEFAULT_MARGIN_GIB * 2**30, 0.1 * capacity)
        try:
            profile, share, _ = plan_profile(trainer, before_model=True)
            box[0] = for_job(
                trainer.cfg,
                profile,
                trainer.mesh.world_size,
                budget,
                trainer.memory_baseline,
                share,
            )
            log.info("%s", box[0].describe())
        except (PlanError, OSError, ValueError) as exc:
            box[0] = f"train.recompute = auto: {exc}"
    if trainer.mesh.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    return box[0]


def _self_check(trainer: Trainer, step_s: float, peak_bytes: float) -> dict[str, Any]:
    """The planner's prediction for this job beside the measurement (planner.selfcheck);
    under recompute auto, for the costliest policy a stage runs."""
    from hyperloom.planner.selfcheck import self_check

    cfg = trainer.cfg
    if trainer.recompute_choice is not None:
        train = dataclasses.replace(cfg.train, recompute=trainer.recompute_choice.costliest)
        cfg = dataclasses.replace(cfg, train=train)
    try:
        profile, share, local = plan_profile(trainer)
        return self_check(cfg, profile, trainer.mesh.world_size, step_s, peak_bytes, share, local)
    except Exception as exc:  # noqa: BLE001 - a failed prediction must not fail the run
        log.warning("planner self-check skipped: %s", exc)
        return {"plan_error": str(exc)}


def add_self_check(
    trainer: Trainer, summary: dict[str, Any], measured: tuple[float, float] | None
) -> None:
    """The planner's predictions beside this run's measured step time and memory, into
    `summary` (main rank; `logging.self_check`). The first run on a machine calibrates
    the planner (about a minute, cached), announced before it starts; the CLI calls this
    after the sample, so that the training result is not kept waiting."""
    from hyperloom.data.build import cache_root
    from hyperloom.planner.selfcheck import profile_path

    cfg = trainer.cfg
    if cfg.logging.self_check == "off" or measured is None:
        return
    key = (trainer.acc.kind, cfg.precision.dtype, trainer.mesh.world_size, cfg.train.host_allocator)
    if cfg.logging.self_check == "auto" and not profile_path(cache_root(cfg.data), *key).exists():
        log.info(
            "planner self-check: calibrating this machine once (about a minute; cached "
            "for later runs; --logging.self_check off skips it)"
        )
    summary.update(_self_check(trainer, *measured))
