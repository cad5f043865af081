"""Every check of a training configuration, run before any work: the top of the configuration layers.

``config`` (option values: types and ranges) -> ``components`` (the library's verdict on names and
parameters) -> :func:`validate` here, which runs both in that order and returns the configuration with its
names spelled as the registries spell them. Nothing is loaded or written; a problem raises
:class:`~optkit.demo.config.ConfigError` listing every message, each naming its flag.
"""

from __future__ import annotations

from .components import canonical, check_components, planned_steps
from .config import ConfigError, TrainConfig, check_values

__all__ = ["validate"]


def validate(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` checked and with canonical names (``lars`` -> ``LARS``); ``ConfigError`` listing all problems.

    Cheap: builds a throw-away train op on a fresh model, loads no data and writes nothing."""
    errors = check_values(cfg)
    if errors:
        raise ConfigError(*errors)
    cfg, errors = canonical(cfg)
    if not errors:
        errors = check_components(cfg, planned_steps(cfg)[1])
    if errors:
        raise ConfigError(*errors)
    return cfg
