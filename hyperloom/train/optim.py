"""AdamW with decoupled weight decay, and the learning-rate schedules.

Schedules are pure functions of the step, so resuming cannot drift: cosine (warmup, then half
a cosine to `min_lr_ratio * lr`; arXiv 1608.03983), wsd (warmup-stable-decay, MiniCPM arXiv
2404.06395: a run extends from any stable-phase checkpoint by changing `train.steps`) and
constant.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hyperloom.config import TrainConfig
from hyperloom.parallel import ParallelModel
from hyperloom.parallel.zero1 import ZeroOneAdamW


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = max(
            1, cfg.steps - cfg.warmup_steps - 1
        )  # the last step (steps - 1) sits at the floor
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd
    decay_steps = max(1, round(cfg.decay_fraction * cfg.steps))
    decay_start = max(cfg.warmup_steps, cfg.steps - decay_steps)
    if step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start + 1) / max(1, cfg.steps - decay_start))
    return peak + (floor - peak) * progress


def build_optimizer(pm: ParallelModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW for the layout: our ZeRO-1 sharded one for zero = 1 with dp > 1, else
    `adamw` over the rank's parameters."""
    if pm.zero == 1 and pm.mesh.size("dcp") > 1:
        return ZeroOneAdamW(
            pm.inner,
            cfg,
            pm.mesh.group("dcp"),
            pm.tp_group,
            counted=pm.norm_counted,
            extra_norm_group=pm.mesh.group("pp"),
            experts=pm.experts,
            etp_group=pm.mesh.group("etp"),
        )
    return adamw(pm.inner, cfg)


def adamw(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors (norm weights) do not. Fused or foreach when possible.
    FSDP2's DTensor parameters and plain ones (experts FSDP leaves alone) go in groups of
    their own: a fused or foreach kernel takes one kind."""
    kinds: dict[bool, tuple[list, list]] = {}  # DTensor or not -> (decay, no_decay)
    for p in model.parameters():
        if p.requires_grad:
            decay, no_decay = kinds.setdefault(hasattr(p, "device_mesh"), ([], []))
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = []
    for decay, no_decay in kinds.values() or [([], [])]:
        groups += [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device/dtype
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
