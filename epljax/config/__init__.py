"""Configuration: the schema of every EPL key (``schema.py``) and ``Config`` (``config.py``).

Each part of epljax reads only its own section (``config.pipeline``, ``config.zero`` ...).
``python -m epljax.config`` prints every key with its type, default and meaning.
"""

from epljax.config.config import Config, all_keys, describe
from epljax.config.schema import (
    AmpConfig,
    AutoConfig,
    ClusterConfig,
    CommunicationConfig,
    ContextConfig,
    GradientCheckpointConfig,
    IOConfig,
    OffloadConfig,
    OptimizerConfig,
    PipelineConfig,
    ZeroConfig,
)

__all__ = [
    "AmpConfig", "AutoConfig", "ClusterConfig", "CommunicationConfig", "Config",
    "ContextConfig", "GradientCheckpointConfig", "IOConfig", "OffloadConfig", "OptimizerConfig",
    "PipelineConfig", "ZeroConfig", "all_keys", "describe",
]
