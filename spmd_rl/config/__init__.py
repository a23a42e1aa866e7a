"""The run's configuration: the sections and their knobs, loading and validation, and the classes it names."""

from spmd_rl.config.loading import describe_schema, load_config
from spmd_rl.config.sections import (
    AlgorithmConfig,
    BufferSection,
    CheckpointSection,
    Config,
    EnvSection,
    EvalSection,
    NoConfig,
    knob,
)

__all__ = [
    "AlgorithmConfig",
    "BufferSection",
    "CheckpointSection",
    "Config",
    "EnvSection",
    "EvalSection",
    "NoConfig",
    "describe_schema",
    "knob",
    "load_config",
]
