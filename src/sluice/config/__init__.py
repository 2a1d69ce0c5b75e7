"""Run configuration: pydantic models (``models.py``) and YAML + override loading (``loading.py``)."""

from sluice.config.data import DataConfig, EvalConfig, ModelConfig, TaskConfig
from sluice.config.loading import ConfigError, dump_config, load_config, steps_of_epochs, validate_config
from sluice.config.models import RewardConfig, RolloutConfig, RunConfig, SluiceConfig, TrainerConfig
from sluice.config.tracking import TrackingConfig

__all__ = [
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SluiceConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainerConfig",
    "dump_config",
    "load_config",
    "steps_of_epochs",
    "validate_config",
]
