"""Where a policy comes from and where it goes: built from the config (the same module on every rank), saved as
policy.pt, and loaded back from a run directory, a checkpoint or a policy file (evaluation, `run.init_from`, which
also takes a .safetensors file).

A loaded policy's `act` also takes what gymnasium gives: numpy (or torch), one observation or a batch.

Over 400 lines: building, copying, saving and loading a policy share their checks (the class's constructor on the
meta device, the weights' fit), hence one module."""

from __future__ import annotations

import json
import os
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from spmd_rl.config import plugins
from spmd_rl.config.loading import load_config
from spmd_rl.config.sections import Config
from spmd_rl.envs import spaces
from spmd_rl.envs.vector import EnvSpec, probe_env
from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.persist.checkpoint import COMPLETE, LATEST, find_checkpoint
from spmd_rl.persist.fileio import checksum_matches, file_kind, load_failure, torch_save_atomic
from spmd_rl.persist.rank_state import ALGORITHM, POLICY, TRAINER, in_component_layout, load_state
from spmd_rl.persist.run_files import CHECKPOINTS_DIR, CONFIG_FILE, POLICY_FILE
from spmd_rl.roles.acting import act
from spmd_rl.run.evaluation import cuda_indices
from spmd_rl.run.state_fit import SAFETENSORS_SUFFIX, load_fitted, read_safetensors
from spmd_rl.runtime.errors import UserError

_RANK_FILE = re.compile(r"rank(\d+)\.pt")


@dataclass(frozen=True)
class PolicySpec:
    """The policy as every rank knows it without building it, read by the contract check (run/contract.py) from its
    instance on the meta device: what lays out every channel, segment and experience file, its size and its shard
    units (comm/sharding.py)."""

    outputs: dict[str, StepField]
    recurrent_state: dict[str, StepField] | None  # None: stateless
    parameters: int
    trained_parameters: int  # those that require grad
    parameter_bytes: int  # the weights in their own dtypes
    shard_units: int

    def to_text(self) -> str:
        """JSON: how the ranks that check the policy tell env ranks, which never import its class, what it is."""
        return json.dumps(
            {
                "outputs": _fields_to_json(self.outputs),
                "recurrent_state": None if self.recurrent_state is None else _fields_to_json(self.recurrent_state),
                "sizes": [self.parameters, self.trained_parameters, self.parameter_bytes, self.shard_units],
            }
        )

    @classmethod
    def from_text(cls, text: str) -> PolicySpec:
        data = json.loads(text)
        state = None if data["recurrent_state"] is None else _fields_from_json(data["recurrent_state"])
        return cls(_fields_from_json(data["outputs"]), state, *data["sizes"])


def _fields_to_json(fields: dict[str, StepField]) -> list:
    return [[name, list(f.shape), str(f.dtype).removeprefix("torch."), f.initial] for name, f in fields.items()]


def _fields_from_json(rows: list) -> dict[str, StepField]:
    return {name: StepField(tuple(shape), getattr(torch, dtype), initial) for name, shape, dtype, initial in rows}


def build_policy(cfg: Config, spec: EnvSpec, policy_cls: type[Policy], device: torch.device | str = "cpu") -> Policy:
    """The module trainer rank 0 trains and broadcasts, initialised (or read from a pretrained folder) from the
    seed; the same module on every rank that builds it (trainer 0's is the one that counts; inference ranks take
    its values: policy_to_receive). Built once per rank that acts or trains with it (run/builders.py)."""
    torch.manual_seed(cfg.train.seed)
    return policy_cls(spec.observation_space, spec.action_space, cfg.policy).to(device)


def policy_to_receive(cfg: Config, spec: EnvSpec, policy_cls: type[Policy], device: torch.device | str) -> Policy:
    """The module an inference rank acts with, built to receive its values: the engines give it trainer 0's weights
    (every parameter) before its first act, so its parameters are zeros, neither initialised nor read from a
    pretrained folder (a VLA's folder is read by trainer 0 alone, not again on every inference rank); its buffers
    are the constructor's own (non-persistent ones, such as rotary frequencies, travel in no weight sync). A class
    whose constructor needs its parameters' values is built as build_policy builds it. The parameters are made on
    the meta device while the buffers are real, as accelerate's init_empty_weights(include_buffers=False) does
    (accelerate is no dependency of ours)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    setattr(torch.nn.Module, "register_parameter", on_meta)  # noqa: B010 - a method of a class, swapped for the build
    try:
        policy = policy_cls(spec.observation_space, spec.action_space, cfg.policy)
    except Exception:  # a constructor that needs real parameter values
        policy = None
    finally:
        setattr(torch.nn.Module, "register_parameter", register)  # noqa: B010
    if policy is None or any(buffer.is_meta for buffer in policy.buffers()):
        return build_policy(cfg, spec, policy_cls, device)
    zeros: dict[int, torch.nn.Parameter] = {}  # one new tensor per meta parameter: tied parameters stay tied
    for module in policy.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                if id(param) not in zeros:
                    zeros[id(param)] = type(param)(
                        torch.zeros_like(param, device=device), requires_grad=param.requires_grad
                    )
                module._parameters[name] = zeros[id(param)]
    if _holds_meta_tensors(policy):
        return build_policy(cfg, spec, policy_cls, device)
    return policy.to(device)


def _holds_meta_tensors(policy: torch.nn.Module) -> bool:
    """Whether a module of the policy keeps a plain tensor attribute (neither parameter nor buffer, alone or in a
    list, tuple or dict) on the meta device: one its constructor derived from a parameter, which no weight sync
    replaces; act failed with 'Tensor on device meta is not on the expected device' (fault pass 6, U7)."""
    for module in policy.modules():
        for value in vars(module).values():
            values = value.values() if isinstance(value, dict) else value
            values = values if isinstance(values, (list, tuple, type({}.values()))) else [value]
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
                return True
    return False


@dataclass
class PrebuiltPolicy:
    """Trainer 0's policy, built by its checks before start (they call act on it there: run/contract.py's
    check_calls) and handed to its builder, which builds none: torch's random state as build_policy left it, put
    back when the builder takes it, so that the run draws what it would have drawn building it there."""

    policy: Policy | None  # None once taken: whoever still holds this object does not keep the module alive
    rng_state: torch.Tensor  # torch.get_rng_state() right after build_policy
    files_deferred: bool = False  # built within reading_deferred (trainers_read_own_rows): its file tensors zeros

    def take(self, device: torch.device | str) -> Policy:
        policy, self.policy = self.policy, None
        assert policy is not None, "the prebuilt policy is taken once"
        torch.set_rng_state(self.rng_state)
        return policy.to(device)


def trainers_read_own_rows(cfg: Config, sharded: bool, algorithm_cls) -> bool:
    """Whether each sharded trainer reads its own rows of the policy's file_sources (a pretrained folder's tensors)
    and trainer 0 builds it without reading them (modules.pretrained.reading_deferred): fsdp trainers handed the
    policy on the meta device (Algorithm.takes_policy_on_meta), unless run.init_from puts other weights into
    trainer 0's build, which are then sent from there."""
    return sharded and algorithm_cls.takes_policy_on_meta(cfg.algo) and not cfg.run.init_from


def policy_on_meta(cfg: Config, spec: EnvSpec, policy_cls: type[Policy]) -> Policy:
    """The policy constructed on the meta device: every parameter's shape and dtype, no memory, no initialisation
    and no random numbers drawn (a pretrained folder is checked against its files, not read). What the checks before
    start and the static spec read; raises whatever the class raises when its constructor needs real tensors."""
    with torch.device("meta"):
        return policy_cls(spec.observation_space, spec.action_space, cfg.policy)


def cpu_copy(
    policy: Policy,
    cfg: Config,
    spec: EnvSpec,
    policy_cls: type[Policy],
    cuda_devices: list[int],
    parameters: bool = True,
) -> Policy:
    """A plain copy of `policy` on the CPU, given its tensors (non-persistent buffers too) without a second
    initialisation: constructed on the meta device where the class allows it, otherwise built as on any rank with
    the random streams of `cuda_devices` and the CPU left as they were. Without `parameters` only the buffers are
    copied (a sharded policy's parameters are shards: the caller loads the gathered full weights into the copy)."""
    try:
        copy = policy_on_meta(cfg, spec, policy_cls).to_empty(device="cpu")
    except Exception:  # a constructor that needs real tensors
        with torch.random.fork_rng(devices=cuda_devices):  # build_policy seeds torch
            copy = build_policy(cfg, spec, policy_cls)
    # By name and with every name of tied tensors: to_empty gives each of them a tensor of its own.
    sources = dict(policy_tensors(policy) if parameters else policy.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, target in policy_tensors(copy) if parameters else copy.named_buffers(remove_duplicate=False):
            target.copy_(sources[name])
    return copy


def policy_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by name, each name of tied ones too."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def save_policy(policy: Policy, run_dir: Path) -> None:
    # Clones: with a weight sync, tensors of several dtypes are views of one byte bucket, which torch.save
    # refuses; the file should hold plain tensors anyway.
    torch_save_atomic({k: v.detach().clone() for k, v in policy.file_state().items()}, run_dir / POLICY_FILE)


def load_policy(path: str | Path, device: str | torch.device = "cpu", config_overrides=()):
    """(policy, cfg): the trained Policy, in eval mode on `device`, and the run's Config (config.yaml with
    `section.key=value` overrides). `path` is a run directory, a checkpoint directory (or a run's checkpoints/, or
    its checkpoints/latest), or a policy.pt / checkpoint rank0.pt file. Any failure is a one-line UserError naming
    the path.

    The policy's `act(obs, deterministic=False)` takes a batch as the framework gives it (a tensor [B, ...] or a
    TensorDict), and also what gymnasium gives: one observation or a batch, as numpy arrays (dicts of them for Dict
    spaces), lists or torch tensors. Given numpy (or lists), it returns numpy; given one observation, outputs
    without the batch dimension: `env.step(policy.act(obs)["action"])` works with a gymnasium env as it is."""
    path = Path(path)
    weights = _weights_location(path)
    passed_over = _passed_over(path) if path.is_dir() else ""
    if passed_over:
        print(f"spmd_rl: note: {passed_over}", file=sys.stderr, flush=True)
    config_file = _config_next_to(weights)
    device = _device(device)
    state = _read_policy_state(weights)

    try:  # the run's classes must still import (load_config imports a user's policy to read its Config)
        cfg = _load_run_config(config_file, list(config_overrides))
        spec = probe_env(cfg.env)
        policy_cls = plugins.load_class(plugins.POLICY, cfg.classes["policy"], Policy)
    except UserError as exc:
        raise UserError(str(exc) if str(config_file) in str(exc) else f"{config_file}: {exc}") from None
    with torch.random.fork_rng(devices=cuda_indices(device)):  # build_policy seeds torch: keep the caller's RNG
        policy = build_policy(cfg, spec, policy_cls, device)
    try:
        load_fitted(policy, policy.from_file_state(state))
    except UserError as exc:  # missing / unexpected keys, shape or dtype mismatches
        raise UserError(
            f"{weights}: its weights do not fit policy.class '{cfg.classes['policy']}' built from "
            f"{config_file} (was the config changed?): {exc}"
        ) from None
    # An acting copy: no parameter needs grad, so act()'s outputs convert to numpy without a no_grad block.
    return accepts_gymnasium_observations(policy.eval().requires_grad_(False)), cfg


def _load_run_config(config_file: Path, overrides: list[str]):
    """The run's config; when a class other than the policy's no longer imports (the algorithm's module is not
    installed where the policy is evaluated), the config as far as acting needs it."""
    try:
        return load_config(config_file, overrides)
    except UserError:
        try:
            return load_config(config_file, overrides, only_policy=True)
        except UserError:
            pass
        raise


def accepts_gymnasium_observations(policy: Policy) -> Policy:
    """Let this policy's `act` take one observation or a batch, numpy or torch (see load_policy); its class's act,
    which takes a batch, is what runs. Only this object changes: the class and its other instances do not."""
    # Bound methods, so a deepcopy acts with its own module. nn.Module's __setattr__ is typed for tensors and
    # modules only: a method is a plain attribute of this object.
    policy._spmd_rl_batch_act = policy.act  # type: ignore[assignment]
    policy.act = types.MethodType(_act_on_any_observation, policy)  # type: ignore[method-assign]  # this object only
    return policy


def _act_on_any_observation(self: Policy, obs, deterministic: bool = False, state=None):
    space = self.observation_space
    single = _is_one_observation(obs, space)
    device = next(iter(self.state_dict().values()), torch.empty(0)).device
    as_numpy = not isinstance(obs, torch.Tensor) and not hasattr(obs, "batch_size")  # tensor or TensorDict: torch
    if not as_numpy:
        batch = obs.unsqueeze(0) if single else obs
    else:  # laid out as the framework does (the env's dtype; Dict spaces as TensorDicts)
        batch = spaces.zeros_of(space, 1 if single else _batch_size(obs, space))
        spaces.write(spaces.numpy_views(batch), obs, 0 if single else None)
    out, next_state = act(self, batch, device, deterministic, state, method=self._spmd_rl_batch_act)
    outputs = {key: _as_given(value, single, as_numpy) for key, value in out.items()}
    # a recurrent policy: (outputs, next state); the state stays as torch gives it
    return outputs if state is None else (outputs, next_state)


def _first_leaf(obs, space: gym.Space):
    """(an observation's first array, its space): Dict spaces descend to their first entry."""
    while isinstance(space, gym.spaces.Dict):
        key = next(iter(space.spaces))
        obs, space = obs[key], space.spaces[key]
    return obs, space


def _is_one_observation(obs, space: gym.Space) -> bool:
    leaf, leaf_space = _first_leaf(obs, space)
    return np.ndim(leaf) == len(leaf_space.shape)


def _batch_size(obs, space: gym.Space) -> int:
    leaf, _ = _first_leaf(obs, space)
    return len(leaf)


def _as_given(value, single: bool, as_numpy: bool):
    if single:
        value = value[0]
    return value.detach().cpu().numpy() if as_numpy and isinstance(value, torch.Tensor) else value


def read_trained_state(path: str | Path, with_algorithm: bool = False) -> tuple[dict, dict | None]:
    """(the Policy's state_dict, the Algorithm's state or None) of a run directory, checkpoint or policy file (a
    policy.pt or a .safetensors file): what `run.init_from` starts a new run from. The algorithm's state exists
    only in checkpoints."""
    weights = trained_state_source(path, with_algorithm)
    policy_state = _read_policy_state(weights)
    if not with_algorithm:
        return policy_state, None
    checkpoint = weights if weights.is_dir() else (weights.parent if (weights.parent / COMPLETE).exists() else None)
    if checkpoint is None:
        raise UserError(
            f"run.init_algorithm=true needs a checkpoint, and {path} gives {weights} (a policy file "
            f"holds no algorithm state); point run.init_from at a checkpoint or its run directory"
        )
    return policy_state, load_state(checkpoint, rank=0, whole=True)[TRAINER][ALGORITHM]


# -- locating and reading the weights ----------------------------------------------------------------------------


def trained_state_source(path: str | Path, with_algorithm: bool = False) -> Path:
    """The policy file or checkpoint directory read_trained_state reads for `path`."""
    path = Path(path)
    # The algorithm's state lives in checkpoints: from a run directory, take its latest one, not policy.pt.
    return find_checkpoint(path) if with_algorithm and path.is_dir() else _weights_location(path)


def _weights_location(path: Path) -> Path:
    """The policy file or checkpoint directory that `path` means."""
    if not path.exists():
        raise UserError(f"{path} does not exist: give a run directory, a checkpoint directory or a {POLICY_FILE}")
    if path.is_file() and path.name == LATEST and path.parent.name == CHECKPOINTS_DIR:
        return find_checkpoint(path.parent)  # checkpoints/latest names the newest checkpoint
    if path.is_file():
        return path
    if (path / POLICY_FILE).is_file():
        return path / POLICY_FILE
    if (path / CONFIG_FILE).is_file() and not (path / CHECKPOINTS_DIR).is_dir():
        raise UserError(f"run directory {path} holds no weights yet (no {POLICY_FILE}, no {CHECKPOINTS_DIR}/)")
    return find_checkpoint(path)


def _passed_over(path: Path) -> str:
    """A note when `path` is a run directory whose policy.pt is there but no regular file (a FIFO, a device, a
    directory, a dangling link): its latest checkpoint is read instead, which the user hears (fault pass 7, R3)."""
    policy_file = path / POLICY_FILE
    if not os.path.lexists(policy_file) or policy_file.is_file():
        return ""
    try:
        what = file_kind(os.stat(policy_file).st_mode)
    except OSError:
        what = "a link to nothing"
    return f"{policy_file} is not a regular file ({what}): it is passed over for the run's latest checkpoint"


def _config_next_to(weights: Path) -> Path:
    """The run's config.yaml: next to a policy file, or up in the run directory (a checkpoint directory is
    <run dir>/checkpoints/iter_N, its rank files one level deeper)."""
    start = weights if weights.is_dir() else weights.parent
    for config in (directory / CONFIG_FILE for directory in (start, *list(start.parents)[:3])):
        if config.is_file():
            return config
        if config.exists():  # a FIFO or a device (a link to /dev/zero): never read it
            raise UserError(f"{config} is {file_kind(config.stat().st_mode)}, not the run's config: restore it")
    raise UserError(
        f"no {CONFIG_FILE} next to {weights} or in the run directory above it: the policy is built "
        f"from the run's config; copy the run's {CONFIG_FILE} next to the weights"
    )


def _read_policy_state(weights: Path) -> dict:
    if weights.is_dir():
        state = load_state(weights, rank=0, whole=True)
        source = weights / "rank0.pt"
    else:
        source = weights
        match = _RANK_FILE.fullmatch(weights.name)
        if match and (weights.parent / COMPLETE).exists():  # through the checkpoint's own size check
            state = load_state(weights.parent, rank=int(match.group(1)), whole=True)
        elif weights.suffix == SAFETENSORS_SUFFIX:
            state = read_safetensors(weights)  # its header holds the sizes: a cut file fails to load
        else:
            state = _torch_load(weights)
    trainer = in_component_layout(state).get(TRAINER) if isinstance(state, dict) else None
    if isinstance(trainer, dict) and isinstance(trainer.get(POLICY), dict):  # a rank file: the trainer's policy
        state = trainer[POLICY]
    elif weights.is_dir() or _RANK_FILE.fullmatch(weights.name):
        raise UserError(
            f"{source} holds no '{POLICY}' entry (a trainer's): give the checkpoint directory (the policy is in "
            f"its rank0.pt)"
        )
    if not (isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise UserError(f"{source} holds no policy weights (expected a Policy's state_dict, as policy.pt holds)")
    return state


def _torch_load(file: Path):
    if checksum_matches(file) is False:
        raise UserError(
            f"{file} is damaged (its contents differ from the checksum saved with them): use another copy, or give "
            f"<run dir>/checkpoints/latest of the run it came from in its place (its newest checkpoint's policy)"
        )
    from spmd_rl.storage.h5file import HDF5_SIGNATURE  # h5py, imported only here

    with open(file, "rb") as head:  # torch would call it pickled objects
        if head.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
            raise UserError(
                f"{file} is an HDF5 file (demonstrations or experience, as spmd_rl.collect and log.experience write "
                f"them), not weights: give a run directory, a checkpoint directory or a {POLICY_FILE}"
            )
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for damaged or foreign files; each means the same here
        first_line = load_failure(exc)
        raise UserError(
            f"{file} cannot be read as weights ({first_line}): is it a complete {POLICY_FILE} or checkpoint file?"
        ) from None


def _device(name: str | torch.device) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device '{name}' is not a torch device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device '{name}': CUDA is not available here; use --device cpu")
    return device
