"""env.id naming a factory: 'package.module:make_env', a function (or an Env class) that returns a gymnasium Env,
the SB3 / CleanRL habit. gymnasium's own 'module:EnvId' form imports the module and then looks EnvId up in its
registry; when the module registers no such id but has a callable of that name, it is registered here under that
name (its entry point, env.kwargs its keyword arguments), so gym.make and gym.make_vec make it on every rank as they
make any registered env. Every rank probes its env before start (envs.vector.probe_env), which registers it there.
Async vectorization forks its workers, which inherit the registration."""

from __future__ import annotations

import sys

import gymnasium as gym


def register_factory(module: str, name: str) -> None:
    """After `module` was imported: register its callable `name` as the env id `name`, unless an env is registered
    under that id (then 'module:name' is gymnasium's own form and means that env)."""
    if name in gym.registry:
        return
    factory = getattr(sys.modules[module], name, None)
    if callable(factory):
        gym.register(id=name, entry_point=factory)
