"""Tracebacks become lines: an env whose constructor or close() raises anything, a step limit of 0 in
env.kwargs, a reset written for the old gym API, and an experience file whose schema names a dtype we never write
end with one line and the documented exit code (2 for bad input and for a plug-in that raises while the checks
before start build it, 4 for an error in the env's code once the run is going), never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import pytest
import torch
from tensordict import TensorDict

from spmd_rl import experience
from spmd_rl.runtime.errors import USER_CODE_EXIT_CODE, USER_ERROR_EXIT_CODE, UserError
from spmd_rl.storage.writer import HDF5Writer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "ci_tiny.yaml")

ENVS = """
import gymnasium as gym

from spmd_rl.modules.actor_critic import ActorCritic


class RaisingCartPole(gym.Wrapper):
    def __init__(self):
        raise ValueError("cannot find the simulator's asset file")  # LINE 8


class OldGymReset(gym.Wrapper):
    def __init__(self):
        super().__init__(gym.make("CartPole-v1"))

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs  # the old gym API: no info


class RaisingClose(gym.Wrapper):
    def __init__(self):
        super().__init__(gym.make("CartPole-v1"))

    def close(self):
        raise RuntimeError("the simulator was already shut down")


class RaisingPolicy(ActorCritic):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("cannot find the pretrained weights")


gym.register("RaisingCartPole-v0", entry_point=RaisingCartPole)
gym.register("OldGymReset-v0", entry_point=OldGymReset)
gym.register("RaisingClose-v0", entry_point=RaisingClose)
"""

CASES = {
    "constructor_raises": (
        ["env.id=bad_envs:RaisingCartPole-v0"],
        USER_ERROR_EXIT_CODE,
        "env.id 'bad_envs:RaisingCartPole-v0' could not be made: ValueError: cannot find the simulator's asset file",
    ),
    "max_episode_steps_0": (
        ["env.kwargs={max_episode_steps: 0}"],
        USER_ERROR_EXIT_CODE,
        "could not be made with env.kwargs {'max_episode_steps': 0}: ValueError: Expect the `max_episode_steps`",
    ),
    # built by the checks before start, like the env above: bad input to fix before the run can begin (exit 2)
    "policy_constructor_raises": (
        ["policy.class=bad_envs:RaisingPolicy"],
        USER_ERROR_EXIT_CODE,
        "policy.class 'bad_envs:RaisingPolicy' could not be built for observation space",
    ),
    # the checks before start close the env that read the spaces: its close() is user code as its constructor is
    "close_raises": (
        ["env.id=bad_envs:RaisingClose-v0"],
        USER_ERROR_EXIT_CODE,
        "env.id 'bad_envs:RaisingClose-v0': its close() failed when the checks before start closed the env that read "
        "its spaces: RuntimeError: the simulator was already shut down",
    ),
    "old_gym_reset": (
        ["env.id=bad_envs:OldGymReset-v0"],
        USER_CODE_EXIT_CODE,
        "reset failed: ValueError: too many values to unpack (expected 2); gymnasium's reset returns (observation, "
        "info)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_env_is_one_line_and_its_exit_code(tmp_path, case):
    overrides, code, says = CASES[case]
    (tmp_path / "bad_envs.py").write_text(textwrap.dedent(ENVS).lstrip())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    env.pop("RANK", None)
    result = subprocess.run(
        [sys.executable, "-m", "spmd_rl.main", "--config", TINY, f"run.dir={tmp_path / 'run'}", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("spmd_rl:") and "note:" not in line]
    assert len(ours) == 1 and says in ours[0], result.stderr[-3000:]
    if case == "constructor_raises":
        assert f"(at {tmp_path / 'bad_envs.py'}:8)" in ours[0], ours[0]


def _rows() -> TensorDict:
    return TensorDict({"action": torch.zeros(2, dtype=torch.int64)}, batch_size=[2])


def _experience_file(path: Path, dtype: str) -> None:
    with HDF5Writer(path, _rows(), chunk_rows=4) as writer:
        writer.append(_rows())
    with h5py.File(path, "r+") as file:
        schema = json.loads(file.attrs["schema"])
        schema["action"]["dtype"] = dtype
        file.attrs["schema"] = json.dumps(schema)


def test_a_schema_with_an_unknown_dtype_is_exit_2_naming_file_and_dataset_in_inspect_and_on_resume(tmp_path, capsys):
    path = tmp_path / "experience_rank0.h5"
    _experience_file(path, "<q9")
    assert experience.main(["inspect", str(path)]) == USER_ERROR_EXIT_CODE
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"error: {path}: dataset 'action' has dtype '<q9' in the schema attribute"), said
    with pytest.raises(UserError, match=f"{path}: dataset 'action' has dtype '<q9'"):  # the writer, on resume
        HDF5Writer(path, _rows(), chunk_rows=4)
    assert path.exists()  # refused, never replaced
