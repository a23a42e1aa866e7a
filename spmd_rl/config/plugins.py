"""Classes named in the config by `module:Class` (like `env.id`), or by a short alias for the built-ins.

Resolving a built-in's config class imports no torch, so `--help` and config errors answer quickly; a user's
class is imported to find its `Config`. Every failure is a UserError naming the section, the class and what to do.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from spmd_rl.config.excerpts import clip, first_line
from spmd_rl.config.sections import NoConfig
from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.signals import raise_early_signal
from spmd_rl.runtime.watchdog import watchdog


@dataclass(frozen=True)
class Kind:
    section: str  # the config section that names the class
    what: str  # what the class is, for messages
    base: str  # the spmd_rl.api class it must subclass
    aliases: dict  # alias -> (class path, config class path or None)
    key: str = ""  # the config key that names the class, when it is not `<section>.class`

    @property
    def setting(self) -> str:
        return self.key or f"{self.section}.class"


ALGORITHM = Kind(
    "algo",
    "algorithm",
    "Algorithm",
    {
        "ppo": ("spmd_rl.algorithms.ppo:PPO", "spmd_rl.algorithms.configs:PPOConfig"),
        "grpo": ("spmd_rl.algorithms.grpo:GRPO", "spmd_rl.algorithms.configs:GRPOConfig"),
        "bc": ("spmd_rl.algorithms.bc:BC", "spmd_rl.algorithms.configs:BCConfig"),
        "sac": ("spmd_rl.algorithms.sac:SAC", "spmd_rl.algorithms.configs:SACConfig"),
        "dqn": ("spmd_rl.algorithms.dqn:DQN", "spmd_rl.algorithms.configs:DQNConfig"),
        "td3": ("spmd_rl.algorithms.td3:TD3", "spmd_rl.algorithms.configs:TD3Config"),
    },
)
POLICY = Kind(
    "policy",
    "policy",
    "Policy",
    {
        "actor_critic": ("spmd_rl.modules.actor_critic:ActorCritic", "spmd_rl.modules.configs:ActorCriticConfig"),
        "squashed_gaussian": (
            "spmd_rl.modules.sac_td3_networks:SquashedGaussianActor",
            "spmd_rl.modules.configs:SquashedGaussianConfig",
        ),
        "transformer": ("spmd_rl.modules.transformer:TransformerPolicy", "spmd_rl.modules.configs:TransformerConfig"),
        "vla": ("spmd_rl.modules.vla:VLAPolicy", "spmd_rl.modules.configs:VLAConfig"),
        "q_network": ("spmd_rl.modules.q_network:QNetwork", "spmd_rl.modules.configs:QNetworkConfig"),
        "deterministic_actor": (
            "spmd_rl.modules.deterministic_actor:DeterministicActor",
            "spmd_rl.modules.configs:DeterministicActorConfig",
        ),
    },
)
ENGINE = Kind(
    "engine",
    "engine",
    "Engine",
    {
        "sync": ("spmd_rl.engines.sync:SyncEngine", "spmd_rl.config.sections:NoConfig"),
        "async": (
            "spmd_rl.engines.asynchronous.engine:AsyncEngine",
            "spmd_rl.engines.asynchronous.config:AsyncEngineConfig",
        ),
    },
)
CALLBACK = Kind("callbacks", "callback", "Callback", {})
KINDS = {kind.section: kind for kind in (ALGORITHM, POLICY, ENGINE, CALLBACK)}
# Env backends are named by env.backend and have no config section of their own (env.kwargs is theirs).
ENV_BACKEND = Kind(
    "env",
    "env backend",
    "EnvBackend",
    {
        "gymnasium": ("spmd_rl.envs.backends.gymnasium:GymnasiumBackend", None),
        "envpool": ("spmd_rl.envs.backends.envpool:EnvPoolBackend", None),
    },
    key="env.backend",
)


MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")  # an absolute, importable module name


def class_path(kind: Kind, name: str) -> str:
    """The `module:Class` a config value names (an alias, or the value itself)."""
    if name in kind.aliases:
        return kind.aliases[name][0]
    module_name, colon, attr = name.partition(":")
    if not colon or not MODULE_NAME.fullmatch(module_name) or not attr.isidentifier():
        aliases = ", ".join(kind.aliases) or "none"
        raise UserError(
            f"{kind.setting} '{clip(name)}' is neither a built-in {kind.what} ({aliases}) nor "
            f"'package.module:Class'; name your class as module:Class (the working directory is "
            f"importable)"
        )
    return name


def config_class(kind: Kind, name: str) -> type:
    """The dataclass holding the named class's own config keys (imports a user's module, not a built-in's)."""
    if name in kind.aliases and kind.aliases[name][1] is not None:
        return _import(kind, kind.aliases[name][1])
    cls = load_class(kind, name)
    config = getattr(cls, "Config", None)
    if config is None:
        return NoConfig
    if not (isinstance(config, type) and dataclasses.is_dataclass(config)):
        raise UserError(
            f"{kind.setting} '{name}': its Config attribute must be a dataclass (the class's own "
            f"config keys), not {config!r}"
        )
    return config


# The spmd_rl.api class a loaded plug-in class subclasses (load_class's base).
PluginT = TypeVar("PluginT")


@overload
def load_class(kind: Kind, name: str) -> type[Any]: ...
@overload
def load_class(kind: Kind, name: str, base: type[PluginT]) -> type[PluginT]: ...
def load_class(kind: Kind, name: str, base: type | None = None) -> type:
    """Import the named class; with `base` (the spmd_rl.api class named by kind.base), check it subclasses it."""
    cls = _import(kind, class_path(kind, name))
    if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
        raise UserError(f"{kind.setting} '{name}' must be a subclass of spmd_rl.api.{kind.base}; got {cls!r}")
    return cls


def _import(kind: Kind, path: str):
    module_name, _, attr = path.partition(":")
    import_path_for_user_code()
    raise_early_signal()  # a signal that came before the import is not left waiting behind it
    try:
        # Bounded like every call into user code (main.py bounds it before the config is read; --help too).
        with watchdog.watch(f"importing module '{module_name}' ({kind.section}.class)"):
            module = importlib.import_module(module_name)
    except UserError:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # a user's module may fail in any way while importing
        raise UserError(
            f"{kind.setting} '{path}': importing module '{module_name}' failed: {import_failure(exc)}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(f"{kind.setting} '{path}': module '{module_name}' has no attribute '{attr}'") from None


def import_failure(exc: BaseException) -> str:
    """What importing a user's module raised, in one short line; SystemExit and KeyboardInterrupt raised by the
    module itself (sys.exit() on import) are failures like any other, never a silent exit."""
    if isinstance(exc, SystemExit):
        return f"it raised SystemExit({clip(repr(exc.code))}) (a module must not exit when imported)"
    if isinstance(exc, KeyboardInterrupt):
        return "it raised KeyboardInterrupt"
    return first_line(exc)


def import_path_for_user_code() -> None:
    """Let a module in the working directory be found the same way under every launcher (python -m puts the cwd
    on sys.path; torchrun's workers and mpirun's ranks may not): plug-in classes and `package.module:EnvId` ids."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
