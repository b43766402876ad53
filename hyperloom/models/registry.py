"""Model registry: family name -> model class, accounting and checkpoint adapter; presets.

Presets are small TOML tables, one file per family in `models/presets/`; the `tiny` preset
is the `ModelConfig` defaults themselves so the default job and the preset cannot drift.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from hyperloom.config import ModelConfig, build_section

if TYPE_CHECKING:  # torch is imported where a model is built: loading a config needs none
    import torch
    from torch import nn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
    # Mixture-of-Experts / MTP families: parameters one token uses (None = all of them), and
    # those of the multi-token-prediction modules inside param_count (None = none).
    active_param_count: Callable[[ModelConfig], int] | None = None
    mtp_param_count: Callable[[ModelConfig], int] | None = None


def _llama() -> ModelFamily:
    from hyperloom.models import llama
    from hyperloom.models.llama.plan import pipeline_chunk, tp_plan

    def build(cfg: ModelConfig) -> nn.Module:
        return llama.Llama(cfg)  # imports torch (lazy attribute): the accounting needs none

    return ModelFamily(
        "llama",
        build,
        llama.param_count,
        llama.training_flops_per_token,
        tp_plan,
        pipeline_chunk,
    )


def _deepseek() -> ModelFamily:
    from hyperloom.models import deepseek
    from hyperloom.models.deepseek.plan import pipeline_chunk, tp_plan

    def build(cfg: ModelConfig) -> nn.Module:
        return deepseek.DeepSeekV3(cfg)

    return ModelFamily(
        "deepseek",
        build,
        deepseek.param_count,
        deepseek.training_flops_per_token,
        tp_plan,
        pipeline_chunk,
        active_param_count=deepseek.active_param_count,
        mtp_param_count=deepseek.mtp_param_count,
    )


_FAMILIES: dict[str, Callable[[], ModelFamily]] = {"llama": _llama, "deepseek": _deepseek}


def family(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        raise KeyError(f"unknown model family '{name}'; known: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]()


@functools.cache
def _presets() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"tiny": dataclasses.asdict(ModelConfig())}
    folder = resources.files("hyperloom.models") / "presets"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            for name, values in tomllib.loads(entry.read_text()).items():
                out[name] = {**values, "preset": name}
    return out


def preset_names() -> list[str]:
    return list(_presets())


def preset_values(name: str) -> dict[str, Any]:
    """Raw model-section values of a preset; KeyError with the known names if unknown."""
    presets = _presets()
    if name not in presets:
        raise KeyError(f"unknown preset '{name}'; known presets: {', '.join(presets)}")
    return dict(presets[name])


def preset_config(name: str) -> ModelConfig:
    return build_section(ModelConfig, preset_values(name), "model")


def build_model(cfg: ModelConfig, device: torch.device | str = "meta") -> nn.Module:
    """The model with parameters on `device` (default meta: no storage, no init)."""
    import torch

    with torch.device(device):
        return family(cfg.family).build(cfg)


def init_model(cfg: ModelConfig, device: torch.device | str, seed: int) -> nn.Module:
    """Build on the meta device, then allocate on `device` and initialise from `seed`."""
    import torch

    return build_model(cfg).materialize(torch.device(device), seed)
