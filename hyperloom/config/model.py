"""The `[model]` section: one flat table whose fields are declared per model family, and presets.

`ModelConfig` composes the family groups (`hyperloom.config.models`): the Llama-style keys
every family reads and the DeepSeek group's MoE / MLA / MTP keys, each group with its own
checks. Presets are small TOML files, one per family in `config/presets/`; `tiny` is the
defaults themselves, so the default job and the preset cannot drift.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperloom.config.base import build_section, knob
from hyperloom.config.models.deepseek import DeepSeekFields, deepseek_problems, deepseek_tp_widths
from hyperloom.config.models.llama import LlamaFields, decoder_problems, llama_tp_widths
from hyperloom.config.models.vlm import VisionFields, vlm_problems, vlm_tp_widths

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FAMILIES = ("llama", "deepseek", "vlm")
PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class ModelChoice:
    """Which model: a preset, and the family that builds it."""

    preset: str = knob("tiny", "preset from the model registry; keys set here override it")
    family: str = knob("llama", "model family in the registry", choices=FAMILIES)


# A dataclass collects its bases' fields from the last base to the first: the choice, then
# the decoder's keys, then DeepSeek's, then the vision encoder's -- the order `hyperloom
# config show` prints.
@dataclass(frozen=True)
class ModelConfig(VisionFields, DeepSeekFields, LlamaFields, ModelChoice):
    """Architecture of the model. The defaults are the `tiny` preset."""

    @property
    def decoder_family(self) -> str:
        """The family of the language model: the family itself, or a vlm's decoder."""
        return self.vlm_decoder if self.family == "vlm" else self.family

    def problems(self, job: JobConfig) -> list[str]:
        """The decoder's shape: sizes, heads and RoPE (every family)."""
        return decoder_problems(self)

    def family_problems(self, job: JobConfig) -> list[str]:
        """The family groups' own keys, and the parallel layouts each family is built for."""
        return deepseek_problems(job) + vlm_problems(job)

    def tp_split_widths(self) -> dict[str, int]:
        """The widths tensor parallelism splits, named for messages (this family's layers)."""
        widths = vlm_tp_widths(self) if self.family == "vlm" else {}
        if self.decoder_family == "deepseek":
            return deepseek_tp_widths(self) | widths
        return llama_tp_widths(self) | widths


@functools.cache
def _presets() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"tiny": dataclasses.asdict(ModelConfig())}
    for path in sorted(PRESET_DIR.glob("*.toml"), key=lambda p: p.name):
        for name, values in tomllib.loads(path.read_text(encoding="utf-8")).items():
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
    """The `ModelConfig` of a preset (unvalidated: a job validates it with the rest)."""
    return build_section(ModelConfig, preset_values(name), "model")
