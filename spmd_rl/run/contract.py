"""The plug-in contract, checked before any process group exists: the classes named in the config import and
subclass the API, the policy builds from the env's spaces, declares its outputs, and `act` returns exactly them,
and the algorithm finds every step field it needs and every policy method it calls, each called with its declared
signature on the sample observations and the actions act gave for them. Each failure is one UserError naming the class
and what to change (exit 2 on every rank, before any rank waits for another; in a layout with env ranks, which never
import the policy's module, the ranks that build it check it and every rank refuses once the process group exists:
run/driver.py's agree_on_policy).

Over 400 lines: every check of the plug-in contract with its one-line refusal, in the order they run, and the
memory checks that read the same instance; split, each part would import the others' helpers."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch
from tensordict import TensorDict
from torch._subclasses.fake_tensor import FakeTensorMode

from spmd_rl.comm import sharding
from spmd_rl.config import plugins
from spmd_rl.config.sections import Config
from spmd_rl.envs.spaces import zeros_of
from spmd_rl.envs.vector import EnvSpec
from spmd_rl.interfaces.algorithm import PER_SAMPLE_SCALARS, Algorithm, Callback, PolicyMethod
from spmd_rl.interfaces.engine import Engine
from spmd_rl.interfaces.policy import (
    ENV_FIELDS,
    EPISODE_START,
    RECURRENT_STATE,
    SUCCESS_FIELDS,
    Policy,
    StepField,
    describe_outputs,
    initial_state,
)
from spmd_rl.roles.messages import segment_message
from spmd_rl.run.policies import PolicySpec, build_policy, policy_on_meta
from spmd_rl.runtime.errors import UserError, describe_exception
from spmd_rl.runtime.limits import check_memory, training_state_bytes

SAMPLE_BATCH = 2  # the sample observations the policy's methods are called on


def load_classes(cfg: Config) -> tuple[type[Policy], type[Algorithm], type, list]:
    """(policy class, algorithm class, engine class, [(callback class, its config)])."""
    policy_cls = plugins.load_class(plugins.POLICY, cfg.classes["policy"], Policy)
    return policy_cls, *load_classes_but_policy(cfg)


def load_classes_but_policy(cfg: Config) -> tuple[type[Algorithm], type, list]:
    """(algorithm class, engine class, [(callback class, its config)]): what an env rank, which never builds the
    policy, imports (the policy's module, a VLA's transformers and peft, stays unimported there)."""
    algorithm_cls = plugins.load_class(plugins.ALGORITHM, cfg.classes["algo"], Algorithm)
    engine_cls = plugins.load_class(plugins.ENGINE, cfg.classes["engine"], Engine)
    callbacks = [(plugins.load_class(plugins.CALLBACK, name, Callback), config) for name, config in cfg.callbacks]
    return algorithm_cls, engine_cls, callbacks


def check_policy(
    cfg: Config,
    spec: EnvSpec,
    policy_cls: type[Policy],
    algorithm_cls: type[Algorithm],
    shards: int = 1,
    calls: bool = True,
) -> PolicySpec:
    """Build the policy, check its size against this host's memory, act on a batch of sample observations, compare
    with its declared outputs; returns its static spec. Built on the meta device (no memory, no initialisation, a
    pretrained folder checked against its files' headers), so no rank builds the policy to check it and env ranks
    never build it. A class whose code needs real values fails there and is checked on a CPU instance, as before.
    Without `calls`, act and the algorithm's policy methods are not called (what the policy declares and its size
    are still checked): for a rank whose peer makes the same calls for it (rank 0, in a layout with env ranks),
    since a VLA's calls as fake tensors take tens of seconds of CPU."""
    name = f"policy.class '{cfg.classes['policy']}'"
    key = "policy.hidden_sizes" if hasattr(cfg.policy, "hidden_sizes") else "the policy's size (its policy.* keys)"
    try:  # SystemExit and KeyboardInterrupt go on: no failure of the meta device
        policy = policy_on_meta(cfg, spec, policy_cls)
    except Exception:
        policy = None
    if policy is not None:
        check_policy_memory(policy, name, key, shards)  # a policy too large is refused before anything is built
        try:  # as fake tensors its methods run on shapes alone, and transformers skips shortcuts that read values
            with FakeTensorMode(allow_non_fake_inputs=True):
                return _check_instance(cfg, spec, algorithm_cls, policy, calls)
        except Exception:
            pass
    policy = build_checked(cfg, spec, policy_cls)
    check_policy_memory(policy, name, key, shards)
    return _check_instance(cfg, spec, algorithm_cls, policy, calls)


def build_checked(cfg: Config, spec: EnvSpec, policy_cls: type[Policy]) -> Policy:
    """build_policy on the CPU, a constructor's failure one UserError naming the class and the spaces."""
    try:
        return build_policy(cfg, spec, policy_cls)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"policy.class '{cfg.classes['policy']}' could not be built for observation space "
            f"{spec.observation_space} and action space {spec.action_space}: {describe_exception(exc)}"
        ) from None


def check_calls(
    cfg: Config, spec: EnvSpec, algorithm_cls: type[Algorithm], policy: Policy, policy_spec: PolicySpec
) -> None:
    """act and the algorithm's policy methods called on `policy`, a real instance the rank goes on to train with
    (check_policy without `calls` checked the rest on the meta device): on real tensors the calls take half the CPU
    of the same calls as fake tensors, and this instance is built anyway. Torch's random state and the instance's
    buffers (a normalizer's statistics) are left as they were, so that the run goes on as if no call was made."""
    name = f"policy.class '{cfg.classes['policy']}'"
    buffers = [(buffer, buffer.detach().clone()) for buffer in policy.buffers()]
    with torch.random.fork_rng(devices=[]):
        obs, acted = _check_act(name, policy, policy_spec.outputs, spec, policy_spec.recurrent_state)
        _check_policy_methods(cfg, policy, algorithm_cls, obs, acted, policy_spec.outputs)
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)


def _check_instance(
    cfg: Config, spec: EnvSpec, algorithm_cls: type[Algorithm], policy: Policy, calls: bool = True
) -> PolicySpec:
    name = f"policy.class '{cfg.classes['policy']}'"
    try:
        outputs = dict(policy.outputs())
    except Exception as exc:
        raise UserError(f"{name}: outputs() failed: {describe_exception(exc)}") from None
    _check_declared(name, outputs)
    _check_action_shape(name, outputs["action"], spec.action_space, spec.action_chunk)
    state = _check_declared_state(name, policy)
    if calls:
        obs, acted = _check_act(name, policy, outputs, spec, state)
    _check_algorithm_needs(cfg, policy, outputs, algorithm_cls, state, spec.success_key is not None)
    if calls:
        _check_policy_methods(cfg, policy, algorithm_cls, obs, acted, outputs)
    algorithm_cls.check_spaces(cfg.algo, spec.observation_space, spec.action_space)
    parameters = list(policy.parameters())
    return PolicySpec(
        outputs=outputs,
        recurrent_state=state,
        parameters=sum(p.numel() for p in parameters),
        trained_parameters=sum(p.numel() for p in parameters if p.requires_grad),
        parameter_bytes=sum(p.numel() * p.element_size() for p in parameters),
        shard_units=len(sharding.shard_units(policy)),
    )


def check_policy_memory(policy: Policy, name: str, key: str, shards: int = 1) -> None:
    """The policy's weights, gradients and Adam state (16 bytes a trained parameter, a frozen one only its weight,
    divided over `shards` ranks when sharded) against this host's memory, counted on the contract check's instance:
    a CPU instance's weights as held, since they are freed before training allocates (a meta one holds none)."""
    parameters = sum(p.numel() for p in policy.parameters())
    frozen = [p for p in policy.parameters() if not p.requires_grad]  # neither gradient nor Adam state
    held = sum(p.untyped_storage().nbytes() for p in policy.parameters() if not p.is_meta)
    frozen_bytes = -(-sum(p.numel() * p.element_size() for p in frozen) // max(1, shards))
    check_memory(
        training_state_bytes(parameters - sum(p.numel() for p in frozen), shards) + frozen_bytes,
        f"{name} ({parameters:,} parameters: weights, gradients and Adam's moments, 16 bytes each (4 if frozen)"
        f"{f' over {shards} shards' if shards > 1 else ''})",
        key,
        held_bytes=held,
    )


def check_planned_memory(cfg: Config, spec: EnvSpec, outputs: dict, plan) -> None:
    """The rollout buffers a trainer holds (its segments, double-buffered, and their concatenation), against this
    host's memory, before anything is allocated."""
    segment = segment_message(spec, outputs, 1, 1)  # one step of one env: bytes scale with steps x envs
    step_bytes = sum(t.element_size() * t.numel() for t in segment["rollout"].values(True, True))
    columns = plan.max_env_columns_per_trainer
    check_memory(
        3 * step_bytes * plan.num_steps * columns,
        f"the rollout buffers of a trainer ({plan.num_steps} steps x {columns} envs x {step_bytes} bytes, 3 copies)",
        "algo.num_steps or env.num_envs",
    )
    batch = getattr(cfg.algo, "batch_size", None)  # an off-policy algorithm's sampled batch (SAC): all trainers
    if isinstance(batch, int) and batch > 0:
        per_trainer = -(-batch // max(1, plan.trainer_ranks))
        # The sample, its device copy, the next observations; and the activations the actor and two critics keep
        # for backward (a float per hidden unit each; what else an algorithm holds is not counted).
        widths = sum(getattr(cfg.policy, "hidden_sizes", None) or ())
        transition_bytes = 4 * step_bytes + 3 * 4 * widths
        check_memory(
            transition_bytes * per_trainer,
            f"a sampled batch of a trainer ({per_trainer} transitions x {transition_bytes} bytes: the sample, its "
            f"copies and the networks' activations)",
            "algo.batch_size",
        )


def _check_declared(name: str, outputs: dict) -> None:
    if "action" not in outputs:
        raise UserError(
            f"{name}: outputs() must declare 'action' (got {list(outputs)}); return "
            f"{{'action': StepField(shape, dtype), ...}}"
        )
    for key, field in outputs.items():
        if not isinstance(field, StepField):
            raise UserError(f"{name}: outputs()['{key}'] must be a spmd_rl.api.StepField(shape, dtype), got {field!r}")
        if key == "obs" or key in ENV_FIELDS or key in SUCCESS_FIELDS:
            raise UserError(f"{name}: outputs() declares '{key}', which the env side records; rename that output")
    if list(outputs)[0] != "action":
        raise UserError(f"{name}: outputs() must list 'action' first (got {list(outputs)})")


def _check_action_shape(name: str, field: StepField, action_space: gym.Space, chunk: int) -> None:
    """A declared action the env cannot take would pass every check here and fail at the first env step, blamed on
    the env (exit 4): compare it with the action space now. With env.action_chunk K > 1 the space is already the
    chunk's, Box [K, *shape] (envs/chunks.py)."""
    expected = tuple(action_space.shape or ())
    if tuple(field.shape) != expected:
        chunked = f" (a chunk of env.action_chunk={chunk} actions)" if chunk > 1 else ""
        raise UserError(
            f"{name}: outputs() declares 'action' of shape {tuple(field.shape)}, but the action space {action_space} "
            f"takes actions of shape {expected}{chunked}; declare StepField({expected}, ...) for 'action'"
        )


def _check_declared_state(name: str, policy: Policy) -> dict[str, StepField] | None:
    """The policy's recurrent state, if it declares one: {name: StepField}, each of a fixed shape."""
    try:
        state = policy.recurrent_state()
    except Exception as exc:
        raise UserError(f"{name}: recurrent_state() failed: {describe_exception(exc)}") from None
    if state is None:
        return None
    if not isinstance(state, dict) or not state:
        raise UserError(
            f"{name}: recurrent_state() must return None (stateless) or a non-empty dict "
            f"{{name: StepField(shape, dtype, initial)}}, got {state!r}"[:400]
        )
    for key, field in state.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise UserError(f"{name}: recurrent_state() names a state {key!r}; use identifiers as names")
        if not isinstance(field, StepField) or not all(isinstance(d, int) and d > 0 for d in field.shape):
            raise UserError(
                f"{name}: recurrent_state()['{key}'] must be a spmd_rl.api.StepField(shape, dtype, initial) "
                f"with positive integer sizes, got {field!r}"
            )
    return state


def _check_act(name: str, policy: Policy, outputs: dict, spec: EnvSpec, state: dict | None = None) -> tuple:
    """(the sample observations, act's outputs for them). A recurrent policy acts from its initial state, and the
    state it returns must be laid out as it declared."""
    batch = SAMPLE_BATCH
    space = spec.observation_space
    obs = zeros_of(space, batch)
    samples = [space.sample() for _ in range(batch)]
    if isinstance(obs, TensorDict):
        for key in obs.keys(include_nested=True, leaves_only=True):
            path = key if isinstance(key, tuple) else (key,)
            for i, sample in enumerate(samples):
                for part in path:
                    sample = sample[part]
                obs[key][i] = torch.as_tensor(sample)
    else:
        for i, sample in enumerate(samples):
            obs[i] = torch.as_tensor(sample)
    device = next(policy.parameters(), torch.empty(0)).device  # the meta device for the meta instance
    obs = obs.to(device)
    for deterministic in (False, True):
        call = f"act(obs, deterministic={deterministic}{', state=state' if state is not None else ''})"
        try:
            with torch.no_grad():
                if state is None:
                    out = policy.act(obs, deterministic=deterministic)
                else:  # a recurrent policy's act takes its state too (Policy.act's docstring)
                    recurrent: Any = policy
                    out = recurrent.act(obs, deterministic=deterministic, state=initial_state(state, batch, device))
        except Exception as exc:
            raise UserError(
                f"{name}: {call} failed on a batch of {batch} sample observations: {describe_exception(exc)}"
            ) from None
        if state is not None:
            out = _check_next_state(name, call, out, state, batch)
        if not hasattr(out, "keys") or set(out.keys()) != set(outputs):
            got = list(out.keys()) if hasattr(out, "keys") else type(out).__name__
            raise UserError(
                f"{name}: act() returned {got}, but outputs() declares {list(outputs)}; return a dict "
                f"with exactly the declared keys"
            )
        _check_shapes(out, outputs, batch, f"{name}: act() returned '{{key}}'", "outputs()", "")
    return obs, out


def _check_shapes(values: dict, fields: dict[str, StepField], batch: int, returned: str, declarer: str, fix: str):
    """Each value a tensor [batch, *shape] of its field's dtype; else a UserError (`returned` formats the key)."""
    for key, field in fields.items():
        value = values[key]
        expected = (batch, *field.shape)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected or value.dtype != field.dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise UserError(
                f"{returned.format(key=key)} as {got} for a batch of {batch}; {declarer} declares "
                f"{describe_outputs({key: field})} per env (so {expected} {field.dtype}){fix}"
            )


def _check_next_state(name: str, call: str, returned, state: dict[str, StepField], batch: int) -> dict:
    """A recurrent act's (outputs, next_state): next_state exactly as recurrent_state() declares. Returns outputs."""
    if not (isinstance(returned, tuple) and len(returned) == 2 and hasattr(returned[1], "keys")):
        raise UserError(
            f"{name}: {call} returned {type(returned).__name__}; a policy that declares recurrent_state() "
            f"returns (outputs, next_state)"
        )
    out, next_state = returned
    if set(next_state.keys()) != set(state):
        raise UserError(
            f"{name}: {call} returned the state {sorted(next_state.keys())}, but recurrent_state() declares "
            f"{sorted(state)}"
        )
    _check_shapes(
        next_state,
        state,
        batch,
        f"{name}: {call} returned the state '{{key}}'",
        "recurrent_state()",
        "; make them agree",
    )
    return out


def _check_algorithm_needs(
    cfg: Config,
    policy: Policy,
    outputs: dict,
    algorithm_cls: type[Algorithm],
    state: dict | None = None,
    reports_success: bool = False,
) -> None:
    algo = f"algo.class '{cfg.classes['algo']}'"
    available = {"obs", *outputs, *ENV_FIELDS, *(SUCCESS_FIELDS if reports_success else ())}
    if state is not None:
        available |= {EPISODE_START, RECURRENT_STATE}
        if RECURRENT_STATE not in algorithm_cls.requires:
            raise UserError(
                f"policy.class '{cfg.classes['policy']}' declares a recurrent state, but {algo} learns from "
                f"single steps (its `requires` lacks '{RECURRENT_STATE}'); choose an algorithm that replays "
                f"sequences (e.g. spmd_rl.algorithms.recurrent_ppo:RecurrentPPO) or a stateless policy"
            )
    missing = [key for key in algorithm_cls.required_fields(cfg.algo) if key not in available]
    unreported = [key for key in missing if key in SUCCESS_FIELDS]
    if unreported:
        raise UserError(
            f"{algo} needs the step field(s) {unreported}, which the env side records only for an env whose step "
            f"info has a success flag; env '{cfg.env.id}' reports none under env.success_key (unset: 'success')"
        )
    if missing:
        raise UserError(
            f"{algo} needs the step field(s) {missing}, which policy.class '{cfg.classes['policy']}' "
            f"does not emit (its outputs: {list(outputs)}); choose a policy that declares them"
        )
    lacking = [
        m.signature() if isinstance(m, PolicyMethod) else m
        for m in algorithm_cls.policy_methods
        if not callable(getattr(policy, m.name if isinstance(m, PolicyMethod) else m, None))
    ]
    if lacking:
        raise UserError(
            f"{algo} calls the policy's {', '.join(lacking)}, which policy.class "
            f"'{cfg.classes['policy']}' lacks; add them or choose another policy"
        )


def _check_policy_methods(
    cfg: Config, policy: Policy, algorithm_cls: type[Algorithm], obs, acted: dict, outputs: dict
) -> None:
    """Call every method the algorithm declares with its signature (PolicyMethod) on the sample observations and
    the actions act() gave for them, and compare what it returns; torch's random state is left as it was."""
    name = f"policy.class '{cfg.classes['policy']}'"
    algo = f"algo.class '{cfg.classes['algo']}'"
    inputs = {"obs": obs, "action": acted["action"]}
    action_shape = tuple(outputs["action"].shape)
    for method in algorithm_cls.policy_methods:
        if not isinstance(method, PolicyMethod):
            continue  # a bare name: only its presence is checked (above)
        call = policy if method.name == "forward" else getattr(policy, method.name)
        what = " and ".join("observations" if arg == "obs" else "actions from act()" for arg in method.args)
        note = f" ({method.note})" if method.note else ""
        try:
            args = [inputs[arg] for arg in method.args]
        except KeyError as exc:
            raise UserError(
                f"{algo} declares policy method {method.signature()} with argument {exc}; its arguments can be "
                f"'obs' and 'action'"
            ) from None
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                result = call(*args)
        except Exception as exc:
            raise UserError(
                f"{algo} calls {name} as {method.signature()}{note}; on a batch of {SAMPLE_BATCH} sample "
                f"{what} it failed: {describe_exception(exc)}"
            ) from None
        problem = _result_problem(method, result, action_shape)
        if problem:
            raise UserError(
                f"{algo} calls {name} as {method.signature()}{note}; on a batch of {SAMPLE_BATCH} sample "
                f"{what} it returned {problem}"
            )


def _result_problem(method: PolicyMethod, result, action_shape: tuple) -> str:
    """'' when `result` is what `method` declares; else what it is instead, in words."""
    names = (method.returns,) if isinstance(method.returns, str) else tuple(method.returns)
    if isinstance(method.returns, str):
        values = (result,)
    elif isinstance(result, (tuple, list)) and len(result) == len(names):
        values = tuple(result)
    else:
        got = f"{len(result)} values" if isinstance(result, (tuple, list)) else _describe(result)
        return f"{got}, not a tuple of {len(names)} tensors ({', '.join(names)})"
    for key, value in zip(names, values):
        if key in PER_SAMPLE_SCALARS:
            expected = (SAMPLE_BATCH,)
        elif key == "action":
            expected = (SAMPLE_BATCH, *action_shape)
        else:
            expected = None
        if not isinstance(value, torch.Tensor):
            return f"{key} as {_describe(value)}, not a tensor"
        if expected is not None and tuple(value.shape) != expected:
            return f"{key} with shape {tuple(value.shape)}, not {expected}"
        if expected is None and (value.dim() == 0 or value.shape[0] != SAMPLE_BATCH):
            return f"{key} with shape {tuple(value.shape)}, not [{SAMPLE_BATCH}, ...] (the batch first)"
    return ""


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
