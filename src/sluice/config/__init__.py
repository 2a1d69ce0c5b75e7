"""Run configuration: pydantic models (``models.py``) and YAML + override loading (``loading.py``)."""

from sluice.config.loading import ConfigError, dump_config, load_config, validate_config
from sluice.config.models import (
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SluiceConfig,
    TaskConfig,
    TrainerConfig,
)

__all__ = [
    "ConfigError",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SluiceConfig",
    "TaskConfig",
    "TrainerConfig",
    "dump_config",
    "load_config",
    "validate_config",
]
