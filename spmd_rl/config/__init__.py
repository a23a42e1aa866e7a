"""The run's configuration: the schema (every knob), loading and validation, and the classes the config names."""

from spmd_rl.config.schema import (AlgorithmConfig, BufferSection, CheckpointSection, Config, EnvSection,
                                   EvalSection, NoConfig, describe_schema, knob, load_config)

__all__ = ["AlgorithmConfig", "BufferSection", "CheckpointSection", "Config", "EnvSection", "EvalSection",
           "NoConfig", "describe_schema", "knob", "load_config"]
