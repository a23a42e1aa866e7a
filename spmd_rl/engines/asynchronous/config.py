"""The async engine's own config section (`engine: {class: async, ...}`), kept free of torch so that `--help` and
config errors answer without importing it. AsyncEngine.Config (engine.py) is AsyncEngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rl.config.sections import knob


@dataclass
class AsyncEngineConfig:
    max_policy_lag: int | None = knob(
        None,
        "policy versions an env step may lag behind the freshest version its "
        "segment could use (0: exactly the sync engine's results; null: the "
        "lag the algorithm declares it tolerates)",
        min=0,
    )
    agree_every: int = knob(
        10,
        "iterations between the all-rank agreements (stops on a signal, timed "
        "checkpoints) when checkpoint.every_iterations is 0; a signal is acted on at the "
        "next agreement",
        min=1,
    )
