"""Typed run configuration: schema, YAML loading with dotted overrides, and its documentation."""

from lmms_train.config._docs import render_config_docs
from lmms_train.config._load import apply_overrides, config_from_dict, config_to_dict, load_config
from lmms_train.config._schema import (
    DatasetConfig,
    LoadFromConfig,
    ModelConfig,
    SyntheticDataConfig,
    TrainConfig,
    TrainerArgs,
)

__all__ = [
    "DatasetConfig",
    "LoadFromConfig",
    "ModelConfig",
    "SyntheticDataConfig",
    "TrainConfig",
    "TrainerArgs",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "render_config_docs",
]
