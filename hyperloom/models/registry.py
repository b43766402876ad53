"""Model registry: family name -> model class, accounting, parallel plans; building models.

The presets (name -> `ModelConfig`) are config data and live with the config
(`hyperloom.config.preset_config`); this module maps a config's family to the code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config import ModelConfig

if TYPE_CHECKING:  # torch is imported where a model is built: loading a config needs none
    import torch
    from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """What the rest of hyperloom needs to know about one model family."""

    name: str
    build: Callable[[ModelConfig], nn.Module]
    param_count: Callable[[ModelConfig], int]
    training_flops_per_token: Callable[[ModelConfig, int], int]
    # model config -> {module path pattern: tensor-parallel style}
    tp_plan: Callable[[ModelConfig], dict[str, str]]
    # (meta model, layer ids, first, last) -> the model cut down to one pipeline chunk
    pipeline_chunk: Callable[[nn.Module, range, bool, bool], nn.Module]
    # model config -> {recompute module: where it sits in a block} (parallel.recompute)
    recompute_plan: Callable[[ModelConfig], dict[str, list]]
    # Mixture-of-Experts / MTP families: parameters one token uses (None = all of them), and
    # those of the multi-token-prediction modules inside param_count (None = none).
    active_param_count: Callable[[ModelConfig], int] | None = None
    mtp_param_count: Callable[[ModelConfig], int] | None = None
    # Towers beside the decoder (a vlm's vision encoder): submodule path -> the recompute plan
    # of its blocks (`layers`), which take the decoder blocks' recompute policy.
    tower_recompute_plans: Callable[[ModelConfig], dict[str, dict[str, list]]] | None = None


def _llama() -> ModelFamily:
    from hyperloom.models import llama
    from hyperloom.models.llama.plan import pipeline_chunk, recompute_plan, tp_plan

    def build(cfg: ModelConfig) -> nn.Module:
        return llama.Llama(cfg)  # imports torch (lazy attribute): the accounting needs none

    return ModelFamily(
        "llama",
        build,
        llama.param_count,
        llama.training_flops_per_token,
        tp_plan,
        pipeline_chunk,
        recompute_plan,
    )


def _deepseek() -> ModelFamily:
    from hyperloom.models import deepseek
    from hyperloom.models.deepseek.plan import pipeline_chunk, recompute_plan, tp_plan

    def build(cfg: ModelConfig) -> nn.Module:
        return deepseek.DeepSeekV3(cfg)

    return ModelFamily(
        "deepseek",
        build,
        deepseek.param_count,
        deepseek.training_flops_per_token,
        tp_plan,
        pipeline_chunk,
        recompute_plan,
        active_param_count=deepseek.active_param_count,
        mtp_param_count=deepseek.mtp_param_count,
    )


def _vlm() -> ModelFamily:
    from hyperloom.models import vlm
    from hyperloom.models.vlm.plan import (
        pipeline_chunk,
        recompute_plan,
        tower_recompute_plans,
        tp_plan,
    )

    def build(cfg: ModelConfig) -> nn.Module:
        return vlm.build_vlm(cfg)

    return ModelFamily(
        "vlm",
        build,
        vlm.param_count,
        vlm.training_flops_per_token,
        tp_plan,
        pipeline_chunk,
        recompute_plan,
        active_param_count=vlm.active_param_count,
        tower_recompute_plans=tower_recompute_plans,
    )


_FAMILIES: dict[str, Callable[[], ModelFamily]] = {
    "llama": _llama,
    "deepseek": _deepseek,
    "vlm": _vlm,
}


def family(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        raise KeyError(f"unknown model family '{name}'; known: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]()


def build_model(cfg: ModelConfig, device: torch.device | str = "meta") -> nn.Module:
    """The model with parameters on `device` (default meta: no storage, no init)."""
    import torch

    with torch.device(device):
        return family(cfg.family).build(cfg)


def init_model(cfg: ModelConfig, device: torch.device | str, seed: int) -> nn.Module:
    """Build on the meta device, then allocate on `device` and initialise from `seed`."""
    import torch

    return build_model(cfg).materialize(torch.device(device), seed)
