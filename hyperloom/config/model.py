"""The `[model]` section: one flat table whose fields are declared per model family, and presets.

`ModelConfig` composes the family groups (`hyperloom.config.models`): the Llama-style keys
every family reads and the DeepSeek group's MoE / MLA / MTP keys, each group with its own
checks. Presets are small TOML files, one per family in `config/presets/`; `tiny` is the
defaults themselves, so the default job and the preset cannot drift.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
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

    @property
    def rope_kind(self) -> str:
        """The RoPE frequency scaling in effect: 'default' at rope_scaling 1 (every kind is
        the identity there), else rope_type, 'auto' being the family's own (llama3 for
        llama, DeepSeek's yarn for deepseek)."""
        if self.rope_scaling <= 1:
            return "default"
        if self.rope_type == "auto":
            return "yarn" if self.decoder_family == "deepseek" else "llama3"
        return self.rope_type

    @property
    def rope_attention_factor(self) -> float:
        """The multiplier on the RoPE cos/sin tables: YaRN's attention factor (yarn_attn_factor,
        or the family's default), 1 for every other kind. Llama's default is YaRN's
        0.1 ln s + 1 (arXiv 2309.00071 eq. 21, Hugging Face's default); DeepSeek's is 1, since
        its MLA scales the softmax by yarn_mscale instead."""
        if self.rope_kind != "yarn":
            return 1.0
        if self.yarn_attn_factor > 0:
            return self.yarn_attn_factor
        if self.decoder_family == "deepseek":
            return 1.0
        return 0.1 * math.log(self.rope_scaling) + 1.0

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


# Presets named "SCHEME:ARG" that a higher layer reads: "hf:DIR", a Hugging Face model
# directory's config.json (registered by `hyperloom.checkpoint.hf`, since the config imports
# nothing else from hyperloom). A reader returns model-section values or raises ValueError.
_PRESET_READERS: dict[str, Callable[[str], dict[str, Any]]] = {}


def register_preset_reader(scheme: str, reader: Callable[[str], dict[str, Any]]) -> None:
    """Let `model.preset = "SCHEME:ARG"` take its values from `reader(ARG)`."""
    _PRESET_READERS[scheme] = reader


def preset_values(name: str) -> dict[str, Any]:
    """Raw model-section values of a preset; KeyError with the known names if unknown, or
    with the reader's reason for a "SCHEME:ARG" preset it cannot read."""
    scheme, sep, arg = name.partition(":")
    if sep and scheme in _PRESET_READERS:
        try:
            values = _PRESET_READERS[scheme](arg)
        except ValueError as exc:
            raise KeyError(f"'{name}': {exc}") from None
        return {**values, "preset": name}
    presets = _presets()
    if name not in presets:
        schemes = "".join(f", or {s}:PATH" for s in _PRESET_READERS)
        raise KeyError(f"unknown preset '{name}'; known presets: {', '.join(presets)}{schemes}")
    return dict(presets[name])


def preset_config(name: str) -> ModelConfig:
    """The `ModelConfig` of a preset (unvalidated: a job validates it with the rest)."""
    return build_section(ModelConfig, preset_values(name), "model")
