"""Typed job configuration: nested dataclasses, TOML presets and dotted command-line overrides.

A `JobConfig` is made of sections (model, parallel, precision, train, data, checkpoint,
logging, resilience, ops), each a module with its dataclass and its own checks, which state
their arithmetic; every field has a one-line doc that `hyperloom config show` prints. The
package is a leaf: it imports nothing else from hyperloom, so every layer can read a job
without torch or model code.
"""

from hyperloom.config.base import (
    ConfigError,
    build_section,
    dump_toml_file,
    dumps_toml,
    knob,
    read_toml,
    to_dict,
)
from hyperloom.config.checkpoint import CheckpointConfig
from hyperloom.config.data import DataConfig
from hyperloom.config.job import (
    JobConfig,
    config_from_dict,
    load_config,
    parse_overrides,
    validate,
)
from hyperloom.config.logging import LoggingConfig
from hyperloom.config.model import ModelConfig, preset_config, preset_names, preset_values
from hyperloom.config.ops import OpsConfig
from hyperloom.config.parallel import (
    PAIRING_SCHEDULES,
    PIPELINE_SCHEDULES,
    ParallelConfig,
    pipeline_chunks,
    pipeline_microbatches,
    schedule_shape_problems,
    world_size_from_env,
)
from hyperloom.config.precision import FP8_GEMMS, PrecisionConfig
from hyperloom.config.resilience import Fault, ResilienceConfig, parse_inject
from hyperloom.config.train import (
    RECOMPUTE_CANDIDATES,
    RECOMPUTE_MODULES,
    TrainConfig,
    is_auto,
    recompute_policy,
)

__all__ = [
    "FP8_GEMMS",
    "PAIRING_SCHEDULES",
    "PIPELINE_SCHEDULES",
    "RECOMPUTE_CANDIDATES",
    "RECOMPUTE_MODULES",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "Fault",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "OpsConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ResilienceConfig",
    "TrainConfig",
    "build_section",
    "config_from_dict",
    "dump_toml_file",
    "dumps_toml",
    "knob",
    "load_config",
    "parse_inject",
    "parse_overrides",
    "pipeline_chunks",
    "pipeline_microbatches",
    "preset_config",
    "preset_names",
    "preset_values",
    "read_toml",
    "schedule_shape_problems",
    "to_dict",
    "validate",
    "world_size_from_env",
    "is_auto",
    "recompute_policy",
]
