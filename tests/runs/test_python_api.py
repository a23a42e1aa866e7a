"""The Python API as a notebook user meets it: `spmd_rl.train(config, overrides)` runs in this process and returns
the run (directory, last metrics, trained policy), trains in chunks with run.stop_after_iterations and resumes,
raises instead of exiting, and leaves the process as it was; `load_policy`'s `act` takes numpy or torch, one
observation or a batch; importing spmd_rl stays cheap; the docs' Python blocks run as written."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from harness.launch import ROOT
from harness.launch import job_env as _env
from harness.runs import TINY

import spmd_rl
from spmd_rl.api import UserError


def test_train_returns_the_run_in_chunks_and_leaves_the_process_as_it_was(tmp_path):
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    threads = torch.get_num_threads()
    overrides = {"run.dir": tmp_path / "run", "run.stop_after_iterations": 3, "policy.hidden_sizes": (16, 16)}

    first = spmd_rl.train(TINY, overrides)
    assert not first.finished and first.dir == tmp_path / "run"
    assert first.stop.startswith("stopped by run.stop_after_iterations=3 after iteration 2; checkpoint ")
    assert first.metrics["iteration"] == 2 and first.metrics["env_steps"] == 96
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    assert torch.get_num_threads() == threads

    second = spmd_rl.train(TINY, overrides)  # the same call resumes, and finishes (8 iterations)
    assert second.finished and second.stop == ""
    assert second.metrics["iteration"] == 7 and second.metrics["env_steps"] == 256
    assert second.cfg.policy.hidden_sizes == [16, 16]
    saved = torch.load(second.dir / "policy.pt", weights_only=True)
    assert all(torch.equal(saved[key], value) for key, value in second.policy.state_dict().items())


def test_the_trained_policy_acts_on_what_gymnasium_gives(tmp_path):
    run = spmd_rl.train(None, ["env.num_envs=2", "algo.num_steps=16", "train.total_steps=64", f"run.dir={tmp_path}"])
    policy = run.policy
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    action = policy.act(obs, deterministic=True)["action"]  # one numpy observation: one numpy action
    assert isinstance(action, np.ndarray) and action.shape == () and env.action_space.contains(action)
    env.step(action)

    batch = np.stack([obs, -obs, obs])
    out = policy.act(batch, deterministic=True)
    assert out["action"].shape == (3,) and out["log_prob"].shape == (3,) and isinstance(out["value"], np.ndarray)
    assert out["action"][0] == action and out["action"][2] == action

    tensor = policy.act(torch.as_tensor(obs), deterministic=True)["action"]  # torch in, torch out
    assert isinstance(tensor, torch.Tensor) and tensor.shape == () and int(tensor) == int(action)
    assert policy.act(torch.as_tensor(batch), deterministic=True)["action"].tolist() == out["action"].tolist()
    assert policy.act(obs.tolist(), deterministic=True)["action"] == action  # a list, like a numpy array

    vector = gym.make_vec("CartPole-v1", num_envs=2)
    observations, _ = vector.reset(seed=0)
    vector.step(policy.act(observations)["action"])  # a vector env's batch in, its actions out


def test_a_loaded_policy_acts_on_one_dict_observation():
    from harness.parts import DictObservations

    from spmd_rl.config.loading import load_config
    from spmd_rl.config.plugins import POLICY, load_class
    from spmd_rl.envs.vector import probe_env
    from spmd_rl.run.policies import accepts_gymnasium_observations, build_policy

    if "DictCartPole-v0" not in gym.registry:
        gym.register(id="DictCartPole-v0", entry_point=lambda: DictObservations(gym.make("CartPole-v1")))
    cfg = load_config(None, ["env.id=DictCartPole-v0"])
    build = lambda: build_policy(cfg, probe_env(cfg.env), load_class(POLICY, cfg.classes["policy"]))  # noqa: E731
    policy = accepts_gymnasium_observations(build().eval().requires_grad_(False))
    env = gym.make("DictCartPole-v0")
    obs, _ = env.reset(seed=0)
    action = policy.act(obs)["action"]
    assert action.shape == () and env.action_space.contains(action)
    assert policy.act({k: np.stack([v, v]) for k, v in obs.items()})["action"].shape == (2,)
    assert "act" in vars(policy) and "act" not in vars(build())  # this object acts so; its class is untouched


def test_errors_raise_instead_of_exiting(tmp_path):
    with pytest.raises(UserError, match="unknown config key 'train.total_stepz'"):
        spmd_rl.train(TINY, {"train.total_stepz": 10})
    with pytest.raises(UserError, match="does not exist"):
        spmd_rl.train(tmp_path / "no_such.yaml")
    with pytest.raises(UserError, match="layout"):  # a split layout needs more than this one process
        spmd_rl.train(TINY, ["layout.mode=split", f"run.dir={tmp_path / 'split'}"])
    with pytest.raises(UserError, match="must look like 'section.key=value'"):
        spmd_rl.train(TINY, ["train.total_steps"])
    assert not (tmp_path / "split").exists()


def test_a_mapping_of_sections_is_a_config_and_overrides_win(tmp_path):
    config = {"env": {"num_envs": 2}, "algo": {"num_steps": 16, "update_epochs": 1}, "train": {"total_steps": 999}}
    run = spmd_rl.train(config, {"train.total_steps": 64, "run.dir": str(tmp_path)})
    assert run.finished and run.cfg.train.total_steps == 64 and run.cfg.algo.update_epochs == 1
    assert run.metrics["iteration"] == 1


def test_importing_spmd_rl_and_its_api_stays_cheap():
    code = (
        "import sys, spmd_rl, spmd_rl.api; "
        "print('tensordict' in sys.modules, callable(spmd_rl.train), spmd_rl.api.train is spmd_rl.train)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # train is resolved on first use without tensordict: it imports the heavy parts when called
    assert result.stdout.split() == ["False", "True", "True"], result.stderr


# -- the docs' Python blocks, as written -----------------------------------------------------------------------

MARKER = "<!-- readme-test -->"


def readme_blocks() -> list[str]:
    """The ```python blocks that follow the marker line in README.md and docs/*.md."""
    text = "\n".join(doc.read_text() for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    return re.findall(re.escape(MARKER) + r"\n```python\n(.*?)\n```", text, re.DOTALL)


def test_the_readme_marks_its_python_api_example():
    blocks = readme_blocks()
    assert len(blocks) >= 1
    assert any("spmd_rl.train(" in block and "load_policy(" in block for block in blocks)
    assert "obs_batch" not in (ROOT / "docs" / "running.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_a_readme_python_block_runs_as_written(tmp_path, index):
    # Run where a user would: a folder of their own, outside the clone (runs/ lands in the test's folder).
    block = readme_blocks()[index]
    result = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if "spmd_rl.train(" in block:  # the API example: it trained, finished, and the policy balances the pole
        lines = result.stdout.strip().splitlines()
        run_dir, finished, iteration, _ = lines[-2].split()
        assert (tmp_path / run_dir / "policy.pt").is_file() and finished == "True" and iteration == "45"
        assert float(lines[-1]) > 100, result.stdout[-3000:]


def test_env_and_inference_ranks_start_without_torch_dynamo():
    # tensordict's import would pull torch._dynamo (about a second per rank); only an optimizer needs it.
    code = (
        "import sys, torch, torch.compiler; allow = torch.compiler.allow_in_graph; "
        "from spmd_rl.runtime.fast_imports import import_tensordict_without_dynamo; "
        "import_tensordict_without_dynamo(); "
        "import spmd_rl.run.driver, spmd_rl.roles.env_runner, spmd_rl.roles.inference_server; "
        "from tensordict import TensorDict; "
        "rows = torch.stack([TensorDict({'x': torch.ones(3, 2)}, batch_size=[3])] * 2)[1, 1:]; "
        "print('torch._dynamo' in sys.modules, torch.compiler.allow_in_graph is allow, tuple(rows['x'].shape))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "True", "(2,", "2)"], result.stderr


def test_a_ddp_trainer_builds_and_learns_without_torch_dynamo(tmp_path):
    # DDP's constructor and forward would import torch._dynamo (over a second of every DDP trainer's start): the
    # wrapper built without it must reduce the same gradients, and once dynamo is imported DDP is built as torch does.
    code = f"""
import sys, torch, torch.distributed as dist
from spmd_rl.runtime.fast_imports import data_parallel_without_dynamo, optimizers_without_dynamo
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
optimizers_without_dynamo()
def gradients():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    wrapped = data_parallel_without_dynamo(module, forward_sync_buffers=False)
    optimizer = torch.optim.Adam(module.parameters(), fused=True)
    optimizer.zero_grad()
    wrapped(torch.arange(12.0).reshape(3, 4)).square().mean().backward()
    return type(wrapped).__name__, [p.grad.clone() for p in module.parameters()]
name, without = gradients()
print(name, "torch._dynamo" in sys.modules, "_dynamo" in vars(torch))  # vars: hasattr would import it
import torch._dynamo
name, with_dynamo = gradients()
print(name, all(torch.equal(a, b) for a, b in zip(without, with_dynamo)))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["DistributedDataParallel", "False", "False", "DistributedDataParallel", "True"], (
        result.stdout + result.stderr
    )
