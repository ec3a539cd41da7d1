"""lmms-train: the YAML-configured trainer that composes the lmms packages.

    lmms-train CONFIG.yaml [section.key=value ...]
    torchrun --nproc_per_node=N -m lmms_train CONFIG.yaml

Programmatic use: `train(load_config("run.yaml", ["trainer_args.max_steps=10"]))`.
"""

from lmms_train._errors import ConfigError, UserError
from lmms_train.cli import main
from lmms_train.config import TrainConfig, load_config

__all__ = ["ConfigError", "TrainConfig", "UserError", "load_config", "main", "train"]


def train(cfg: TrainConfig) -> dict:
    """Run training for `cfg`; returns the last step's metrics (see `lmms_train._trainer`)."""
    from lmms_train._trainer import train as _train

    return _train(cfg)
