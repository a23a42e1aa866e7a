"""The extension API of spmd_rl: what a researcher writes to bring a network, a loss or a loop, named in YAML.

    policy:    {class: my_pkg.nets:CNNActorCritic, channels: [32, 64]}   # or a built-in: actor_critic, ...
    algo:      {class: my_pkg.a2c:A2C, learning_rate: 7e-4}              # or: ppo, sac
    engine:    {class: sync}
    callbacks: [my_pkg.hooks:LogGradNorm]

Policy     A torch module that acts. Built the same way (same seed) on every rank that acts or trains, from the
           env's spaces and its own config section. Everything it holds (parameters and buffers) is what ships to
           the inference ranks and what policy.pt holds; nothing else ships. It declares its per-step outputs
           (`outputs()`: the action plus any extra fields, with shapes and dtypes) so every channel, segment and
           experience file is laid out before the first message.
Algorithm  Learns, on trainer ranks only. Owns its optimizers and whatever need not ship (critics, targets,
           replay). Declares the step fields it needs (`requires`), what it calls on the policy with each call's
           signature (`policy_methods`: PolicyMethod entries, called on sample observations before start), its
           schedule (weight-sync period, random warm-up, tolerated policy lag: 0 on-policy, ANY_LAG off-policy)
           and its whole state (`state_dict` / `load_state_dict`). `learn(segment, iteration)` counts iterations
           from 0, as metrics.jsonl does.
Context    What the framework hands an Algorithm so it never writes distributed code: the trainer group, device,
           timeout, run directory, and helpers (data parallelism, gradient averaging, bounded collectives,
           a sharded replay buffer, normalizer merging).
Callback   Called on trainer ranks after every iteration; may add scalars to metrics.jsonl and TensorBoard.
EnvBackend A kind of vector env (`env.backend: gymnasium`, `envpool`, or module:Class): probes the spaces, makes a
           rank's vector envs (groups, seeds, wrappers), and says its step limit, its envs' checkpoint state and
           what evaluation may wrap (spmd_rl/envs/backend.py).
Engine     The loops one rank runs for the whole run (`engine.class: sync`, `async`, or module:Class). Its
           `run(run)` gets a `Run`: the plan, this rank's role, builders of the role components (EnvRunner,
           InferenceServer, Trainer, each with its channels open) and the run's control points (`restore` to load
           the components' state, `end_iteration` for checkpoints and stops, the report for metrics and
           callbacks). The built-in engines (spmd_rl/engines/) are written with exactly these names; see
           docs/architecture.md. `SyncEngine` and `AsyncEngine` (its subclass) are extended through hooks.

Each class has a `Config` dataclass of its own keys (see spmd_rl.config.sections.knob), typed bool, int, float, str,
dict, list[T] (T one of the first four) or any of these | None: they are validated like every other key (unknown
key: exit 2 with a did-you-mean; a key of another type: exit 2 naming it), listed by `--help`, saved in config.yaml.

What an Algorithm's `learn` receives, per iteration, from its env ranks (a TensorDict, batch_size []):
    rollout         [T, N] time-major: obs (as the env gives it: dtype, shape, Dict spaces as nested keys),
                    every field of the policy's outputs() (action, ...), reward (float32), terminated,
                    truncated (bool), valid (bool: False on the step after an episode end, which only reset
                    the env: its action was ignored and it is no transition), episode_return, episode_length,
                    episode_done (set where an episode ended)
    next_obs        [N] the observation after the last step
    policy_version  [T] the policy version each step acted with
T is algo.num_steps; N counts the env columns of all env ranks this trainer learns from.

PPO's needs from a policy, as it declares them (the contract calls each before start; a policy that fails one stops
with exit 2 naming its class):
    outputs         action, log_prob [B], value [B]
    evaluate(obs, action) -> (log_prob [B], entropy [B], value [B]), with gradients
    value(obs) -> value [B]
    forward(obs, action) -> evaluate(obs, action)   (PPO calls policy(obs, action), which DDP wraps)
SAC's: sample(obs) -> (action [B, *shape] in env units, log_prob [B]), reparameterized; features(obs) -> [B, ...].

Recurrent policies: `recurrent_state() -> {name: StepField(shape, dtype, initial)}` (None: stateless, the default)
declares a state per env; acting is then `act(obs, deterministic, state=state) -> (outputs, next_state)`. The
framework keeps the state where acting happens (never in the module, so it never ships), resets it to `initial`
where an episode starts, saves it in checkpoints, and adds to every segment rollout["episode_start"] [T, N] (bool)
and segment["recurrent_state"] {name: [N, *shape]}, the state each column entered its first step with (before that
step's reset). An algorithm that replays sequences lists EPISODE_START and RECURRENT_STATE in `requires`; a
recurrent policy under any other algorithm, or a state shaped otherwise than declared, is exit 2 before start.
Built in: spmd_rl.modules.recurrent:RecurrentActorCritic and spmd_rl.algorithms.recurrent_ppo:RecurrentPPO.

Training from Python (one process): `spmd_rl.train(config, overrides) -> TrainedRun` (dir, finished, metrics,
policy, cfg); `load_policy(path)` gives a policy whose `act` also takes numpy, one observation or a batch.
"""

from __future__ import annotations

from typing import Any

from spmd_rl.config.sections import AlgorithmConfig, NoConfig, knob
from spmd_rl.interfaces.algorithm import ANY_LAG, Algorithm, Callback, PlanFacts, PolicyMethod, Schedule
from spmd_rl.interfaces.context import Context
from spmd_rl.interfaces.engine import Engine
from spmd_rl.interfaces.policy import (
    ACTIVE,
    CHUNK_VALID,
    ENV_FIELDS,
    EPISODE_START,
    RECURRENT_STATE,
    Policy,
    StepField,
    describe_outputs,
    initial_state,
)
from spmd_rl.runtime.errors import UserCodeError, UserError
from spmd_rl.runtime.lazy_names import import_lazily

# What an engine is written with. Imported when first used: they pull in tensordict (seconds: torch._dynamo), and
# a user's policy or algorithm module imports this one to answer --help and config errors at once.
_ENGINE_TYPES = {
    "Run": "spmd_rl.run.run",
    "COLOCATED": "spmd_rl.run.run",
    "ENV": "spmd_rl.run.run",
    "INFERENCE": "spmd_rl.run.run",
    "TRAINER": "spmd_rl.run.run",
    "Plan": "spmd_rl.run.plan",
    "Reporter": "spmd_rl.run.report",
    "MetricsLogger": "spmd_rl.run.metrics",
    "EnvRunner": "spmd_rl.roles.env_runner",
    "InferenceServer": "spmd_rl.roles.inference_server",
    "InferenceParts": "spmd_rl.roles.inference_server",
    "UniformActions": "spmd_rl.roles.inference_server",
    "Trainer": "spmd_rl.roles.trainer",
    "PolicyLagError": "spmd_rl.roles.trainer",
    "combine_segments": "spmd_rl.roles.trainer",
    "observation_message": "spmd_rl.roles.messages",
    "action_message": "spmd_rl.roles.messages",
    "segment_message": "spmd_rl.roles.messages",
    "evaluate": "spmd_rl.run.evaluation",
    # An env backend (env.backend: module:Class) and the engines a user's engine usually extends.
    "EnvBackend": "spmd_rl.envs.backend",
    "EnvSpec": "spmd_rl.envs.backend",
    "finish_vector_env": "spmd_rl.envs.backend",
    "SyncEngine": "spmd_rl.engines.sync",
    "AsyncEngine": "spmd_rl.engines.asynchronous",
    # Training and loading from Python (the names spmd_rl itself exports).
    "train": "spmd_rl.main",
    "TrainedRun": "spmd_rl.main",
    "load_policy": "spmd_rl.run.policies",
}

__all__ = [
    "ANY_LAG",
    "Algorithm",
    "AlgorithmConfig",
    "Callback",
    "Context",
    "Engine",
    "ACTIVE",
    "CHUNK_VALID",
    "ENV_FIELDS",
    "EPISODE_START",
    "RECURRENT_STATE",
    "NoConfig",
    "PlanFacts",
    "Policy",
    "PolicyMethod",
    "Schedule",
    "StepField",
    "UserCodeError",
    "UserError",
    "describe_outputs",
    "initial_state",
    "knob",
    *_ENGINE_TYPES,
]


def __getattr__(name: str) -> Any:
    return import_lazily(globals(), _ENGINE_TYPES, __name__, name)
