"""The whole job: its sections put together, loaded from TOML and overrides, and validated.

Loading merges plain dicts before any dataclass exists: the defaults (the `tiny` model on the
built-in corpus), then `model.preset`'s values, then the TOML file and the `--section.key
value` overrides. `validate` collects each section's checks and mutates nothing, so a
`JobConfig` that passed `load_config` is the job.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from hyperloom.config.base import (
    CliValue,
    ConfigError,
    build_section,
    deep_merge,
    knob,
    read_toml,
    suggest,
    type_hints,
)
from hyperloom.config.checkpoint import CheckpointConfig
from hyperloom.config.data import DataConfig
from hyperloom.config.logging import LoggingConfig
from hyperloom.config.model import ModelConfig, preset_values
from hyperloom.config.ops import OpsConfig
from hyperloom.config.parallel import ParallelConfig
from hyperloom.config.precision import PrecisionConfig
from hyperloom.config.resilience import ResilienceConfig
from hyperloom.config.train import TrainConfig


@dataclass(frozen=True)
class JobConfig:
    """A whole training job."""

    model: ModelConfig = knob(doc="model architecture", factory=ModelConfig)
    parallel: ParallelConfig = knob(doc="parallel layout", factory=ParallelConfig)
    precision: PrecisionConfig = knob(doc="numeric formats", factory=PrecisionConfig)
    train: TrainConfig = knob(doc="training loop", factory=TrainConfig)
    data: DataConfig = knob(doc="data", factory=DataConfig)
    checkpoint: CheckpointConfig = knob(doc="checkpoints", factory=CheckpointConfig)
    logging: LoggingConfig = knob(doc="reporting", factory=LoggingConfig)
    resilience: ResilienceConfig = knob(doc="self-healing training", factory=ResilienceConfig)
    ops: OpsConfig = knob(doc="fused operators", factory=OpsConfig)


def _section_types() -> dict[str, type]:
    return dict(type_hints(JobConfig).items())


def validate(cfg: JobConfig, world_size: int | None = None) -> None:
    """Cross-field checks, each section's own. Raises `ConfigError` listing every problem,
    arithmetic shown; the parallel layout is checked against `world_size` (default
    torchrun's WORLD_SIZE)."""
    p = [
        *cfg.model.problems(cfg),
        *cfg.train.problems(cfg),
        *cfg.data.problems(cfg),
        *cfg.checkpoint.problems(cfg),
        *cfg.resilience.problems(cfg),
        *cfg.logging.problems(cfg),
        *cfg.parallel.problems(cfg, world_size),
        *cfg.model.family_problems(cfg),
        *cfg.precision.problems(cfg),
        *cfg.ops.problems(cfg),
    ]
    if p:
        raise ConfigError(p)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--train.steps", "200", "--model.dim=256"]` -> `{"train": {"steps": "200"}, ...}`.

    Values stay strings here; they are converted with the field's type when the config is
    built, so the error for a bad value can name the field and its type.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(
                f"unexpected argument '{token}': overrides look like --section.key value"
            )
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and "." in args[i + 1]):
                raise ConfigError(f"override --{key} has no value")
            value = args[i + 1]
            i += 1
        i += 1
        parts = key.replace("-", "_").split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(
                f"override --{key}: expected --section.key (e.g. --train.steps 200); "
                f"sections are {', '.join(_section_types())}"
            )
        out.setdefault(parts[0], {})[parts[1]] = CliValue(value)
    return out


def _check_tables(raw: dict[str, Any]) -> None:
    """Every top-level name a known section, and a table."""
    sections = _section_types()
    problems: list[str] = []
    for name, value in raw.items():
        if name not in sections:
            problems.append(
                f"unknown section '[{name}]'{suggest(name, list(sections))}; "
                f"sections are: {', '.join(sections)}"
            )
        elif not isinstance(value, dict):
            problems.append(f"'{name}' must be a table ([{name}]), got {value!r}")
    if problems:
        raise ConfigError(problems)


def config_from_dict(raw: dict[str, Any], world_size: int | None = None) -> JobConfig:
    """Build and validate a `JobConfig` from raw nested dicts (TOML or overrides).

    `world_size` defaults to torchrun's WORLD_SIZE (1 outside torchrun).
    """
    sections = _section_types()
    _check_tables(raw)
    problems: list[str] = []

    model_raw = dict(raw.get("model", {}))
    preset = model_raw.get("preset")
    # A table that sets every field (a run's saved config.toml) needs nothing from its
    # preset: an `hf:DIR` preset then loads without DIR, which may be gone since the run.
    complete = set(model_raw) >= {f.name for f in dataclasses.fields(sections["model"])}
    if preset is not None and not (complete and ":" in str(preset)):
        try:
            base = preset_values(str(preset))
        except KeyError as exc:
            raise ConfigError(f"model.preset: {exc.args[0]}") from None
        # The preset's values are typed already; user keys are layered on top.
        model_raw = {**base, **model_raw}
    built: dict[str, Any] = {}
    for name, cls in sections.items():
        section_raw = model_raw if name == "model" else raw.get(name, {})
        try:
            built[name] = build_section(cls, section_raw, name)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    cfg = JobConfig(**built)
    validate(cfg, world_size)
    return cfg


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    world_size: int | None = None,
) -> JobConfig:
    """The job from an optional TOML file plus dotted overrides, validated (against
    `world_size`, default torchrun's WORLD_SIZE)."""
    raw = read_toml(path) if path else {}
    _check_tables(raw)  # before the overrides' tables could hide a section of the wrong type
    if overrides:
        raw = deep_merge(raw, parse_overrides(overrides))
    return config_from_dict(raw, world_size)
