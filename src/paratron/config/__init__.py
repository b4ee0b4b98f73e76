"""Typed configuration: schema (dataclasses), loading (YAML, CLI, Megatron names), validation."""

from paratron.config.loading import build_config, config_from_dict, config_to_dict
from paratron.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    LRScheduleConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)
from paratron.config.validation import validate

__all__ = [
    "Config", "ModelConfig", "ParallelConfig", "OptimizerConfig", "LRScheduleConfig", "DataConfig",
    "TrainingConfig", "CheckpointConfig", "LoggingConfig", "build_config", "config_from_dict",
    "config_to_dict", "validate",
]
