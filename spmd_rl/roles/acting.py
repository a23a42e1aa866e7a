"""Acting: the one path from observations to a policy's outputs, for every caller (the sync and async inference
servers, the colocated loop through the sync server, evaluation's episodes, a loaded policy's `act`).

`act` is the forward pass itself (no grad, on the policy's device, the recurrent state in and out, the outputs
checked against `outputs()` when asked); `act_for_replies` is a server's step around it (warm-up actions, the
per-env recurrent state, timed), and `write_reply` fills one env rank's reply (its outputs and policy version)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch

from spmd_rl.interfaces.policy import RECURRENT_STATE, StepField
from spmd_rl.runtime.errors import UserCodeError


def act(policy, obs, device: torch.device, deterministic: bool = False, state=None, fields=None, method=None):
    """(outputs, next state): one forward pass of `policy` for a batch of observations, without grad (the API's
    promise; a user's act need not say so), the observations moved to `device`. A recurrent policy gets `state`
    and returns its next state; a stateless one gets none and the next state is None. With `fields` ({key:
    StepField}, the policy's outputs()), the outputs are checked against them (UserCodeError, exit 4).

    `method` is the act to call when it is not `policy.act` (a loaded policy's `act` is the wrapper that takes
    gymnasium's observations and calls this with the act it replaced: run/policies.py). `policy.act`, not the
    class's: FSDP2 hooks a sharded policy's act on the instance."""
    method = method or policy.act
    with torch.no_grad():
        obs = obs.to(device, non_blocking=True)
        if state is None:
            out, next_state = method(obs, deterministic=deterministic), None
        else:
            out, next_state = method(obs, deterministic=deterministic, state=state)
    if fields is not None:
        check_act_outputs(policy, out, fields, obs.shape[0])
    return out, next_state


def act_for_replies(
    policy,
    obs,
    device: torch.device,
    fields: dict[str, StepField],
    uniform_actions=None,
    states=None,
    served: Sequence[int] = (),
    starts: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
    replies: Sequence[dict] = (),
    watched=None,
) -> tuple[list[np.ndarray], float]:
    """An inference server's forward pass for the env ranks `served` (their observations concatenated in `obs`):
    (the outputs as numpy arrays in `fields` order, the seconds from the observations to them). `uniform_actions`
    (warm-up steps) replaces the policy; `states` (a recurrent policy's RecurrentStates) is reset where `starts`
    say an episode starts, and the state each env entered the step with is written into its reply's
    recurrent_state first (`replies`, in the order of `served`). `watched` bounds the policy's call (the
    watchdog's context; None: unbounded)."""
    clock = time.perf_counter()
    if uniform_actions is not None:
        out = uniform_actions(obs.shape[0])
    else:
        with watched or nullcontext():
            state = None if states is None else _entering_state(states, served, starts, replies)
            out, next_state = act(policy, obs, device, state=state, fields=fields)
            if states is not None:
                states.store(served, next_state)
    outputs = [out[key].cpu().numpy() for key in fields]
    return outputs, time.perf_counter() - clock


def _entering_state(
    states, served: Sequence[int], starts: list[torch.Tensor] | tuple[torch.Tensor, ...], replies: Sequence[dict]
) -> dict:
    """The state the served envs act from (reset at episode starts), after writing into each reply the state its
    envs entered the step with (what a segment records as its first step's)."""
    entering = states.entering(served)
    offset = 0
    for reply in replies:
        views = reply[RECURRENT_STATE]
        count = next(iter(views.values())).shape[0]
        for name, view in views.items():
            view[:] = entering[name][offset : offset + count].cpu().numpy()
        offset += count
    start = starts[0] if len(starts) == 1 else torch.cat(starts)
    return states.reset(entering, start)


def write_reply(
    reply: dict, keys: list[str], outputs: list[np.ndarray], offset: int, version: int, seconds: float, idle_s: float
):
    """Fill one env rank's reply (numpy views of its buffer) with its rows of `outputs` from `offset`, the policy
    version that acted, the forward pass's seconds and the server's idle seconds before it; returns the offset of
    the next env rank's rows."""
    count = reply["action"].shape[0]
    for key, value in zip(keys, outputs):
        reply[key][:] = value[offset : offset + count]
    reply["policy_version"][0] = version
    reply["inference_s"][0] = seconds
    reply["idle_s"][0] = idle_s
    return offset + count


def check_act_outputs(policy, out, fields: dict[str, StepField], batch: int) -> None:
    """act's outputs on every step, against the contract checked before start: each declared key a tensor of
    [batch, *shape] and the declared dtype (not the values: a few attribute reads per key). Without it a batch of
    the wrong size was broadcast into the replies and a wrong dtype cast, silently. A NaN in a floating output is
    the policy's too (one reduction per key): unchecked, it surfaced as the update's non-finite loss and was blamed
    on the algorithm. Infinities pass (a masked logit is -inf). UserCodeError (exit 4) naming the key."""
    name = f"{type(policy).__module__}:{type(policy).__qualname__}"
    for key, field in fields.items():
        try:
            value = out[key]
        except (KeyError, TypeError, IndexError):
            value = None
        if (
            isinstance(value, torch.Tensor)
            and value.dtype == field.dtype
            and value.shape[0:1] == (batch,)
            and value.shape[1:] == field.shape
        ):
            if value.is_floating_point() and bool(torch.isnan(value).any()):
                raise UserCodeError(
                    f"policy.class '{name}': act() returned NaN in '{key}' (for a batch of {batch} observations, "
                    f"{int(torch.isnan(value).sum())} value(s)); the policy's forward pass produced it (its weights, "
                    f"or observations it does not expect): fix the policy, or normalize its inputs "
                    f"(policy.normalize_obs)"
                )
            continue
        got = (
            f"{tuple(value.shape)} {value.dtype}"
            if isinstance(value, torch.Tensor)
            else ("nothing" if value is None else type(value).__name__)
        )
        raise UserCodeError(
            f"policy.class '{name}': act() returned '{key}' as {got} for a batch of {batch} observations, but "
            f"outputs() declares {field.shape} {field.dtype} per env, i.e. {(batch, *field.shape)} {field.dtype}; "
            f"act must keep the declared shape and dtype on every step"
        )
