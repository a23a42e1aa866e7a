"""The plug-in API from a user's side: a policy, an algorithm and a callback written in a folder outside the package,
named in YAML by module:Class, trained in every layout; the plug-in contract's errors; --help and --dry-run; the
cross-trainer statistics gather; and the determinism the PPO/SAC regression rests on.

The user's modules are written into a temporary folder and found through PYTHONPATH or the working directory, as a
user's would be. Budgets are tiny: these prove the wiring, not learning.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import runs
from harness.launch import ROOT
from harness.launch import job_env as _env
from harness.multiproc import assert_all_ok, run_ranks
from harness.runs import REQUIRED_METRICS, SAC_TINY, TINY, read_metrics, records_without_timings
from tensordict import TensorDict

from spmd_rl.roles.trainer import Trainer

# ---------------------------------------------------------------------------------------------------------------
# The user's folder

PLUG_NETS = '''
"""A user's policies, written against spmd_rl.api alone."""
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from spmd_rl.api import Policy, StepField
from spmd_rl.config.sections import knob


@dataclass
class CategoricalMLPConfig:
    hidden: int = knob(32, "hidden layer width")


class CategoricalMLP(Policy):
    """A categorical policy with one extra per-step output, logits_max (the largest logit)."""

    Config = CategoricalMLPConfig

    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        self.net = nn.Sequential(nn.Linear(observation_space.shape[0], config.hidden), nn.Tanh(),
                                 nn.Linear(config.hidden, int(action_space.n)))

    def outputs(self):
        return {"action": StepField((), torch.int64), "log_prob": StepField((), torch.float32),
                "logits_max": StepField((), torch.float32)}

    def forward(self, obs, action):
        logits = self.net(obs)
        log_prob = torch.log_softmax(logits, -1).gather(-1, action.unsqueeze(-1)).squeeze(-1)
        return log_prob, logits.max(-1).values

    def act(self, obs, deterministic=False):
        logits = self.net(obs)
        action = logits.argmax(-1) if deterministic else torch.distributions.Categorical(logits=logits).sample()
        log_prob = torch.log_softmax(logits, -1).gather(-1, action.unsqueeze(-1)).squeeze(-1)
        return {"action": action, "log_prob": log_prob, "logits_max": logits.max(-1).values}


class MissingOutput(CategoricalMLP):
    def act(self, obs, deterministic=False):
        out = super().act(obs, deterministic)
        del out["logits_max"]
        return out


class WrongShape(CategoricalMLP):
    def act(self, obs, deterministic=False):
        out = super().act(obs, deterministic)
        out["logits_max"] = out["logits_max"].unsqueeze(-1)
        return out


class WrongDtype(CategoricalMLP):
    def act(self, obs, deterministic=False):
        out = super().act(obs, deterministic)
        out["logits_max"] = out["logits_max"].double()
        return out


class WrongShapeSlowOnRank0(WrongShape):
    """The same contract error, found later on rank 0 (a busier rank), which speaks for every rank."""

    def __init__(self, observation_space, action_space, config):
        if os.environ.get("RANK") == "0":
            time.sleep(3.0)
        super().__init__(observation_space, action_space, config)


class NotAPolicy(nn.Module):
    Config = CategoricalMLPConfig
'''

PLUG_SAC = '''
"""SAC's built-in actor, subclassed by a user to record which state the acting module holds."""
import json
import os
from dataclasses import dataclass
from pathlib import Path

from spmd_rl.config.sections import knob
from spmd_rl.modules.configs import SquashedGaussianConfig
from spmd_rl.modules.sac_td3_networks import SquashedGaussianActor


@dataclass
class RecordingActorConfig(SquashedGaussianConfig):
    record_dir: str = knob("", "folder where every rank records the state keys of the module it acts with")


class RecordingActor(SquashedGaussianActor):
    """SAC's actor, recording on every act() which state the acting module holds (the inference rank's copy is
    the one weight sync fills)."""

    Config = RecordingActorConfig

    def act(self, obs, deterministic=False):
        self.acts = getattr(self, "acts", 0) + 1
        path = Path(self.config.record_dir) / f"acting_module_rank{os.environ.get('RANK', '0')}.json"
        path.with_suffix(".tmp").write_text(json.dumps({"acts": self.acts, "keys": sorted(self.state_dict())}))
        path.with_suffix(".tmp").replace(path)
        return super().act(obs, deterministic)
'''

PLUG_ALGOS = '''
"""A user's algorithm: REINFORCE over one rollout, checking the policy's extra step field on the way."""
import json
from dataclasses import dataclass
from typing import ClassVar

import torch

from spmd_rl.api import Algorithm, AlgorithmConfig
from spmd_rl.config.sections import knob


@dataclass
class ReinforceConfig(AlgorithmConfig):
    default_policy: ClassVar[str] = "plug_nets:CategoricalMLP"
    learning_rate: float = knob(1e-2, "Adam learning rate", min=0.0)
    gamma: float = knob(0.99, "discount factor", min=0.0, max=1.0)


class Reinforce(Algorithm):
    Config = ReinforceConfig
    requires = ("log_prob", "logits_max")

    def __init__(self, policy, config, context):
        super().__init__(policy, config, context)
        self.model = context.data_parallel(policy)
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=config.learning_rate)

    def learn(self, segment, iteration):
        rollout = segment["rollout"]
        steps, envs = rollout.batch_size
        logits_max = rollout["logits_max"]
        assert logits_max.shape == (steps, envs) and logits_max.dtype == torch.float32, (logits_max.shape,
                                                                                          logits_max.dtype)
        log_prob, recomputed_max = self.model(rollout["obs"], rollout["action"])
        # The field holds what the acting policy computed for these very observations (same weights: on-policy).
        assert torch.allclose(recomputed_max.detach(), logits_max, atol=1e-5), "logits_max is not the policy's"
        assert torch.allclose(log_prob.detach(), rollout["log_prob"], atol=1e-5), "log_prob is not the policy's"
        done = (rollout["terminated"] | rollout["truncated"]).float()
        returns = torch.empty_like(rollout["reward"])
        running = torch.zeros(envs)
        for t in reversed(range(steps)):
            running = rollout["reward"][t] + self.config.gamma * running * (1 - done[t])
            returns[t] = running
        valid = rollout["valid"].float()
        advantage = returns - (returns * valid).sum() / valid.sum().clamp(min=1)
        loss = -(log_prob * advantage * valid).sum() / valid.sum().clamp(min=1)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        with open(self.context.run_dir / f"learn_rank{self.context.rank}.jsonl", "a") as f:
            f.write(json.dumps({"iteration": iteration, "logits_max_shape": list(logits_max.shape)}) + "\\n")
        return {"reinforce_loss": loss.item(), "logits_max_mean": logits_max.mean().item()}


class NeedsValue(Reinforce):
    requires = ("log_prob", "value")
'''

PLUG_HOOKS = '''
"""A user's callback: records that it ran on this trainer, and adds a scalar to metrics.jsonl."""
from spmd_rl.api import Callback


class CountIterations(Callback):
    def on_iteration_end(self, iteration, metrics, algorithm):
        assert "reinforce_loss" in metrics and metrics["iteration"] == iteration, sorted(metrics)
        if self.context.rank == 0:  # the first trainer sees the whole metrics.jsonl line
            assert "episode_return_mean" in metrics and "time_env_s" in metrics, sorted(metrics)
        with open(self.context.run_dir / f"callback_rank{self.context.rank}.txt", "a") as f:
            f.write(f"{iteration}\\n")
        return {"callback_iteration_x10": 10.0 * iteration}
'''

PLUG_BROKEN = """
raise RuntimeError("plug_broken refuses to import")
"""

PLUG_CONFIG = """
run:
  name: plug
env:
  id: CartPole-v1
  num_envs: 2
algo:
  class: plug_algos:Reinforce
  num_steps: 16
policy:
  class: plug_nets:CategoricalMLP
  hidden: 16
callbacks: [plug_hooks:CountIterations]
buffer:
  log_experience: true
train:
  total_steps: 256
dist:
  timeout_s: 60
log:
  progress: false
  tensorboard: false
"""


@pytest.fixture  # a few files, written per test: the module's tests need not share a worker
def plugins(tmp_path_factory) -> Path:
    """A user's folder, outside the package: four modules, a broken one, and a config naming them."""
    folder = tmp_path_factory.mktemp("user_plugins")
    for name, text in (
        ("plug_nets.py", PLUG_NETS),
        ("plug_algos.py", PLUG_ALGOS),
        ("plug_hooks.py", PLUG_HOOKS),
        ("plug_sac.py", PLUG_SAC),
        ("plug_broken.py", PLUG_BROKEN),
        ("plug.yaml", PLUG_CONFIG),
    ):
        (folder / name).write_text(textwrap.dedent(text).lstrip())
    return folder


def run_main(
    *args,
    nproc: int = 0,
    cwd: Path = ROOT,
    pythonpath: Path | None = None,
    timeout: float = 240,
    launcher: str = "forked",
) -> subprocess.CompletedProcess:
    env = _env()
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH", "")]))
    return runs.run_main(*args, nproc=nproc, timeout=timeout, cwd=cwd, env=env, launcher=launcher)


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# A user's policy, algorithm and callback in every layout; the extra step field reaches learn() and the HDF5 file

SPLIT_4 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
LAYOUTS = {
    # name: (overrides, ranks, trainer ranks, iterations, found through)
    "one_process": ([], 0, [0], 8, "pythonpath"),
    "colocated_2": ([], 2, [0, 1], 4, "cwd"),
    "split_4": (SPLIT_4 + ["weights.verify_every=1"], 4, [0], 4, "cwd"),
}


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=[pytest.mark.slow] if spec[1] else []) for name, spec in LAYOUTS.items()]
)
def test_user_policy_algorithm_and_callback_train_in_every_layout(plugins, tmp_path, layout):
    overrides, nproc, trainers, iterations, found_through = LAYOUTS[layout]
    run_dir = tmp_path / "run"
    if found_through == "pythonpath":  # run from the repository: only PYTHONPATH finds the user's modules
        result = run_main(
            "--config", str(plugins / "plug.yaml"), f"run.dir={run_dir}", *overrides, nproc=nproc, pythonpath=plugins
        )
    else:  # run from the user's folder with no PYTHONPATH: the working directory finds them
        result = run_main("--config", "plug.yaml", f"run.dir={run_dir}", *overrides, nproc=nproc, cwd=plugins)
    _ok(result)
    assert "plug_algos:Reinforce (policy plug_nets:CategoricalMLP)" in result.stdout

    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == list(range(iterations))
    assert REQUIRED_METRICS | {"reinforce_loss", "logits_max_mean", "callback_iteration_x10"} <= set(records[-1])
    # The callback's scalar, returned on the first trainer, is in every line.
    assert [r["callback_iteration_x10"] for r in records] == [10.0 * i for i in range(iterations)]
    for rank in trainers:
        # learn() saw the extra field with its declared shape on every trainer, every iteration (and asserted it
        # equals the policy's own logits_max: a failed assert would have ended the run with exit code 4).
        learned = [json.loads(line) for line in (run_dir / f"learn_rank{rank}.jsonl").read_text().splitlines()]
        assert [entry["iteration"] for entry in learned] == list(range(iterations))
        columns = 2 * (2 if layout == "split_4" else 1)  # a split trainer learns from 2 env ranks x 2 envs
        assert all(entry["logits_max_shape"] == [16, columns] for entry in learned)
        # The callback ran on every trainer after every iteration.
        ran = (run_dir / f"callback_rank{rank}.txt").read_text().split()
        assert ran == [str(i) for i in range(iterations)]
    saved = torch.load(run_dir / "policy.pt", weights_only=True)
    assert sorted(saved) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]

    # The extra field is a column of every trainer's experience file.
    inspect = subprocess.run(
        [sys.executable, "-m", "spmd_rl.experience", "inspect", str(run_dir)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.returncode == 0, inspect.stderr
    for rank in trainers:
        assert f"experience_rank{rank}.h5" in inspect.stdout
    assert len(re.findall(r"^\s+logits_max\s+.*float32", inspect.stdout, re.MULTILINE)) == len(trainers), inspect.stdout


# ---------------------------------------------------------------------------------------------------------------
# Weight sync ships exactly the Policy's state


@pytest.mark.slow
def test_sac_split_ships_exactly_the_policy_state_and_no_critic(plugins, tmp_path):
    # 4 ranks: trainer 0, inference 1, env 2 and 3. RecordingActor is SAC's actor recording, on every act(), the
    # state keys of the module that acts; weights.verify_every=1 compares the weight group's checksums every sync.
    run_dir, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    result = run_main(
        *SAC_TINY,
        f"run.dir={run_dir}",
        "policy.class=plug_sac:RecordingActor",
        f"policy.record_dir={record}",
        "weights.verify_every=1",
        *SPLIT_4,
        nproc=4,
        cwd=plugins,
    )
    _ok(result)
    assert len(read_metrics(run_dir)) == 12

    from gymnasium.spaces import Box

    from spmd_rl.modules.configs import SquashedGaussianConfig
    from spmd_rl.modules.sac_td3_networks import SquashedGaussianActor

    pendulum_obs, pendulum_action = Box(-8.0, 8.0, (3,)), Box(-2.0, 2.0, (1,))
    actor_keys = sorted(
        SquashedGaussianActor(pendulum_obs, pendulum_action, SquashedGaussianConfig(hidden_sizes=[16, 16])).state_dict()
    )
    # What trainer 0 saves is the actor's state, nothing SAC owns (critics, targets, temperature) ...
    assert sorted(torch.load(run_dir / "policy.pt", weights_only=True)) == actor_keys
    # ... and the inference rank acted all run long with a module holding exactly those keys.
    acting = json.loads((record / "acting_module_rank1.json").read_text())
    assert acting["keys"] == actor_keys
    assert acting["acts"] > 2  # more than the contract check's two calls: this is the serving module
    assert not [key for key in acting["keys"] if "q1" in key or "q2" in key or "critic" in key]


# ---------------------------------------------------------------------------------------------------------------
# Every bad plug-in exits 2 with one line naming the class

BAD_PLUGINS = {
    # name: (overrides, what the line must say)
    "no_module": (
        ["policy.class=plug_nowhere:Net"],
        ["policy.class 'plug_nowhere:Net'", "importing module 'plug_nowhere' failed", "ModuleNotFoundError"],
    ),
    "no_attribute": (
        ["policy.class=plug_nets:NoSuchPolicy"],
        ["policy.class 'plug_nets:NoSuchPolicy'", "has no attribute 'NoSuchPolicy'"],
    ),
    "import_raises": (
        ["algo.class=plug_broken:Reinforce"],
        ["algo.class 'plug_broken:Reinforce'", "RuntimeError: plug_broken refuses to import"],
    ),
    "not_a_subclass": (
        ["policy.class=plug_nets:NotAPolicy"],
        ["policy.class 'plug_nets:NotAPolicy'", "must be a subclass of spmd_rl.api.Policy"],
    ),
    "act_missing_key": (
        ["policy.class=plug_nets:MissingOutput"],
        [
            "policy.class 'plug_nets:MissingOutput'",
            "act() returned ['action', 'log_prob']",
            "outputs() declares ['action', 'log_prob', 'logits_max']",
        ],
    ),
    "act_wrong_shape": (
        ["policy.class=plug_nets:WrongShape"],
        ["policy.class 'plug_nets:WrongShape'", "'logits_max' as (2, 1)"],
    ),
    "act_wrong_dtype": (
        ["policy.class=plug_nets:WrongDtype"],
        ["policy.class 'plug_nets:WrongDtype'", "'logits_max' as (2,) torch.float64"],
    ),
    "requires_missing_field": (
        ["algo.class=plug_algos:NeedsValue"],
        [
            "algo.class 'plug_algos:NeedsValue'",
            "needs the step field(s) ['value']",
            "policy.class 'plug_nets:CategoricalMLP'",
        ],
    ),
    "unknown_key": (
        ["policy.hiden=8"],
        ["unknown config key 'policy.hiden'", "policy 'plug_nets:CategoricalMLP'", "did you mean 'policy.hidden'?"],
    ),
    "sac_alpha_0_autotune": (
        ["--config", str(ROOT / "configs" / "sac_pendulum.yaml"), "algo.alpha=0"],
        ["algo.alpha=0.0 with algo.autotune=true"],
    ),
}


# Under torchrun, one case per place a plug-in is checked (loading, the plan's field check, the act probe): the
# others take the same path there, and each launch costs seconds.
UNDER_TORCHRUN = ("not_a_subclass", "requires_missing_field", "act_wrong_shape")
BAD_PLUGIN_RUNS = [pytest.param(case, 0, id=f"{case}-one_process") for case in BAD_PLUGINS] + [
    pytest.param(case, 2, id=f"{case}-torchrun_2", marks=pytest.mark.slow) for case in UNDER_TORCHRUN
]


@pytest.mark.parametrize("case, nproc", BAD_PLUGIN_RUNS)
def test_a_bad_plugin_exits_2_with_one_line_naming_it(plugins, tmp_path, case, nproc):
    overrides, expected = BAD_PLUGINS[case]
    run_dir = tmp_path / "run"
    config = [] if "--config" in overrides else ["--config", "plug.yaml"]
    result = run_main(*config, *overrides, f"run.dir={run_dir}", nproc=nproc, cwd=plugins, launcher="torchrun")
    ours = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("spmd_rl:")]
    assert len(ours) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "error:" in ours[0] and all(text in ours[0] for text in expected), ours[0]
    if nproc:
        assert result.returncode == 1  # torchrun's code for any failed worker; the workers' own code is 2:
        assert re.search(r"exitcode\s*:\s*2\b", result.stderr), result.stderr[-3000:]
    else:
        assert result.returncode == 2
        assert result.stderr.strip() == ours[0]  # nothing but the one line: no traceback
    assert not run_dir.exists()  # every check runs before the run directory is made


@pytest.mark.slow
def test_under_torchrun_the_error_line_is_printed_when_rank_0_finds_it_last(plugins, tmp_path):
    # Rank 1 finds the error 3 s before rank 0, which speaks for both: torchrun stops every worker as soon as one
    # exits, so rank 1 must not exit first.
    result = run_main(
        "--config",
        "plug.yaml",
        "policy.class=plug_nets:WrongShapeSlowOnRank0",
        f"run.dir={tmp_path / 'run'}",
        nproc=2,
        cwd=plugins,
        launcher="torchrun",
    )
    assert result.returncode == 1
    ours = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("spmd_rl:")]
    assert len(ours) == 1, result.stderr[-3000:]
    assert "rank 0: error: policy.class 'plug_nets:WrongShapeSlowOnRank0'" in ours[0]


# ---------------------------------------------------------------------------------------------------------------
# --help and --dry-run


def test_help_lists_the_keys_of_the_selected_classes(plugins, capsys):
    timings = {}
    for name, args, cwd, keys in (
        (
            "sac_pendulum",
            ["--config", str(ROOT / "configs" / "sac_pendulum.yaml")],
            ROOT,
            ["algo.tau", "algo.autotune", "policy.hidden_sizes", "(class sac;"],
        ),
        (
            "user classes",
            ["--config", "plug.yaml"],
            plugins,
            ["policy.hidden", "algo.learning_rate", "(class plug_nets:CategoricalMLP;", "callbacks[0]:"],
        ),
    ):
        start = time.perf_counter()
        result = run_main(*args, "--help", cwd=cwd)
        timings[name] = time.perf_counter() - start
        _ok(result)
        for key in keys:
            assert key in result.stdout, (name, key)
    assert "algo.tau" not in result.stdout  # the user's algorithm has no SAC keys
    with capsys.disabled():  # measured, not asserted: machines differ
        print(f"\n--help wall time: {', '.join(f'{k} {v:.2f}s' for k, v in timings.items())}")


@pytest.mark.slow
def test_dry_run_runs_one_iteration_in_the_split_layout(plugins):
    # A budget of many iterations; --dry-run runs one, with every role, channel and one weight sync.
    result = run_main("--config", "plug.yaml", "train.total_steps=100000", *SPLIT_4, "--dry-run", nproc=4, cwd=plugins)
    _ok(result)
    assert "spmd_rl: dry run passed: one iteration in the real layout" in result.stdout, result.stdout
    assert re.findall(r"^iter +\d+", result.stdout, re.MULTILINE) == ["iter     0"]  # the console's one iteration
    # Its temporary run directory is removed once it passed (tests/runs/test_smaller_traps.py checks that).


# ---------------------------------------------------------------------------------------------------------------
# Statistics of all trainers reach the first one

EPISODES = {0: [(10.0, 3)], 1: [(20.0, 5), (30.0, 7)]}  # per trainer: (return, length) of the episodes it saw


def _gather_on_two_trainers(rank: int, world_size: int) -> None:
    steps, envs = 4, 2
    done = torch.zeros(steps, envs, dtype=torch.bool)
    returns, lengths = torch.zeros(steps, envs), torch.zeros(steps, envs, dtype=torch.int64)
    for i, (episode_return, length) in enumerate(EPISODES[rank]):
        done[i, i % envs] = True
        returns[i, i % envs], lengths[i, i % envs] = episode_return, length
    segment = TensorDict(
        {
            "rollout": TensorDict(
                {"episode_done": done, "episode_return": returns, "episode_length": lengths}, batch_size=[steps, envs]
            ),
            "env_s": torch.tensor([1.0 + rank]),
            "action_wait_s": torch.tensor([0.5]),
            "inference_s": torch.tensor([0.25]),
            "rollout_s": torch.tensor([2.0]),
            "inference_idle_s": torch.tensor([0.125]),
        },
        batch_size=[],
    )
    trainer = Trainer(
        algorithm=None,
        segment_channels=[],
        segment_sources=[],
        episode_slots=steps * envs,
        group=dist.group.WORLD,
        describe=f"rank {rank}",
    )
    statistics = trainer.gather_statistics(segment)
    if rank != 0:
        assert statistics is None  # only the first trainer logs
        return
    everyone = [episode for episodes in EPISODES.values() for episode in episodes]
    assert sorted(statistics["returns"].tolist()) == sorted(r for r, _ in everyone)
    assert sorted(statistics["lengths"].tolist()) == sorted(float(n) for _, n in everyone)
    assert statistics["env_ranks"] == 2.0 and statistics["env_s"] == 3.0 and statistics["inference_s"] == 0.5
    assert statistics["rollout_s"] == 4.0 and statistics["inference_idle_s"] == 0.25


def test_gather_statistics_merges_every_trainers_episodes_on_the_first():
    assert_all_ok(run_ranks(_gather_on_two_trainers, 2, timeout_s=30))


# ---------------------------------------------------------------------------------------------------------------
# Determinism: what the PPO/SAC regression against the pre-refactor code rests on


def test_ci_tiny_twice_with_one_seed_gives_identical_metrics_and_weights(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for run_dir in runs:
        _ok(run_main("--config", TINY, f"run.dir={run_dir}", "train.seed=7"))
    first, second = (records_without_timings(d) for d in runs)
    assert len(first) == 8 and first == second
    weights = [torch.load(d / "policy.pt", weights_only=True) for d in runs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
