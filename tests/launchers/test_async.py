"""The async engine (engine.class: async): exact at lag 0, the lag bound held, failures end the job, V-trace's
math, a user's algorithm that declares its lag.

End-to-end runs are small (ci_tiny); they prove the schedule and the bounds, not learning curves (see
benchmarks/async.py)."""

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from harness import runs
from harness.launch import free_port as _free_port
from harness.launch import job_env, rank_env, with_pythonpath
from harness.runs import SAC_TINY

from spmd_rl.algorithms.ppo import compute_gae
from spmd_rl.algorithms.vtrace import vtrace

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "ci_tiny.yaml")
SPLIT4 = ("layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2")
SPLIT5 = ("layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=3")


def vtrace_at_lag(lag: int) -> tuple[str, ...]:
    return ("engine.class=async", f"engine.max_policy_lag={lag}", "algo.vtrace=true")


TIMING_KEYS = ("sps", "wall_s", "cpu_s")


def _env(**extra):
    return with_pythonpath(job_env(**extra), ROOT)


def run_main(*args, nproc: int = 0, timeout: float = 240, cwd: Path = ROOT, **env) -> subprocess.CompletedProcess:
    return runs.run_main(*args, nproc=nproc, timeout=timeout, cwd=cwd, env=_env(**env))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def learning_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without what depends on the clock or exists only in async mode."""
    return [
        {k: v for k, v in r.items() if not (k.startswith("time_") or k.startswith("policy_lag") or k in TIMING_KEYS)}
        for r in records(run_dir)
    ]


def same_weights(a: Path, b: Path) -> bool:
    pa, pb = torch.load(a / "policy.pt"), torch.load(b / "policy.pt")
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


# ---------------------------------------------------------------------------------------------------------------
# Correctness anchor


@pytest.mark.slow
def test_lag_0_gives_exactly_the_sync_engines_result_and_a_stopped_run_resumes_to_it(tmp_path):
    """At lag 0 the async engine is the sync engine, metrics and weights; and it checkpoints at an agreed iteration
    (run.stop_after_iterations): stop + resume equals one run. Two trainers, two inference ranks and verified
    weights at lag 0: the SAC case below."""
    common = ("--config", TINY, "train.total_steps=512", *SPLIT4)
    sync = run_main(*common, f"run.dir={tmp_path / 'sync'}", "engine.class=sync", nproc=4)
    assert sync.returncode == 0, sync.stderr[-3000:]
    lagged = run_main(
        *common, f"run.dir={tmp_path / 'async'}", "engine.class=async", "engine.max_policy_lag=0", nproc=4
    )
    assert lagged.returncode == 0, lagged.stderr[-3000:]
    assert learning_records(tmp_path / "sync") == learning_records(tmp_path / "async")
    assert same_weights(tmp_path / "sync", tmp_path / "async")
    assert all(r["policy_lag_max"] == 0 for r in records(tmp_path / "async"))

    parts = (*common, f"run.dir={tmp_path / 'parts'}", "engine.class=async", "engine.max_policy_lag=0")
    stopped = run_main(*parts, "run.stop_after_iterations=2", nproc=4)
    assert "rerun the same command to resume" in stopped.stderr, stopped.stderr[-3000:]
    resumed = run_main(*parts, nproc=4)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert learning_records(tmp_path / "async") == learning_records(tmp_path / "parts")
    assert same_weights(tmp_path / "async", tmp_path / "parts")


SAC_SPLIT6 = (
    *SAC_TINY,
    "layout.mode=split",
    "layout.trainer=2",
    "layout.inference=2",
    "layout.env=2",
    "weights.verify_every=1",
)


@pytest.mark.slow
def test_sac_async_at_lag_0_equals_sync_and_runs_with_any_lag(tmp_path):
    """SAC (random warm-up, replay sharded over 2 trainers) runs async unchanged; at lag 0 exactly as sync. Its
    warm-up updates have no collective, so trainer 0 publishes versions before trainer 1 has its segments: the
    inference rank of env 1 must not take them in early."""
    sync = run_main(*SAC_SPLIT6, f"run.dir={tmp_path / 'sync'}", nproc=6)
    assert sync.returncode == 0, sync.stderr[-3000:]
    exact = run_main(
        *SAC_SPLIT6, f"run.dir={tmp_path / 'exact'}", "engine.class=async", "engine.max_policy_lag=0", nproc=6
    )
    assert exact.returncode == 0, exact.stderr[-3000:]
    assert learning_records(tmp_path / "sync") == learning_records(tmp_path / "exact")
    assert same_weights(tmp_path / "sync", tmp_path / "exact")
    free = run_main(*SAC_SPLIT6, f"run.dir={tmp_path / 'free'}", "engine.class=async", nproc=6)
    assert free.returncode == 0, free.stderr[-3000:]
    assert len(records(tmp_path / "free")) == 12


@pytest.mark.slow
def test_checkpoints_and_a_stop_at_lag_2_are_taken_at_agreed_iterations_and_the_run_resumes(tmp_path):
    """With env ranks ahead of the trainer, every rank still meets at the agreed iterations (rule 4)."""
    run_dir = tmp_path / "run"
    common = (
        "--config",
        TINY,
        f"run.dir={run_dir}",
        "train.total_steps=2880",
        *SPLIT5,
        *vtrace_at_lag(2),
        "checkpoint.every_iterations=4",
    )
    stopped = run_main(*common, "run.stop_after_iterations=10", nproc=5)
    assert stopped.returncode != 0 and "rerun the same command to resume" in stopped.stderr, stopped.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip().endswith("9")
    resumed = run_main(*common, nproc=5)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert [r["iteration"] for r in records(run_dir)] == list(range(30))
    assert all(r["policy_lag_max"] <= 2 for r in records(run_dir))


# ---------------------------------------------------------------------------------------------------------------
# The lag bound


def test_the_lag_bound_is_never_exceeded_and_lag_happens(tmp_path):
    # 3 env ranks, one of them slower: the others run ahead as far as the bound lets them.
    run_dir = tmp_path / "run"
    result = run_main(
        "--config",
        TINY,
        f"run.dir={run_dir}",
        "train.total_steps=2880",
        *SPLIT5,
        *vtrace_at_lag(1),
        nproc=5,
    )
    ours = "\n".join(line for line in result.stderr.splitlines() if line.startswith("spmd_rl:"))
    assert result.returncode == 0, ours or result.stderr[-3000:]  # every rank's line, not torchrun's report
    lags = [(r["policy_lag_mean"], r["policy_lag_max"]) for r in records(run_dir)]
    assert len(lags) == 30
    # The trainer checks every step it receives (PolicyLagError otherwise); the metrics say the same.
    assert all(0 <= mean <= worst <= 1 for mean, worst in lags)
    assert "max policy lag 1" in result.stdout


def test_the_trainer_refuses_a_step_beyond_the_bound():
    from spmd_rl.roles.trainer import PolicyLagError, Trainer

    trainer = Trainer(
        algorithm=None, segment_channels=[], segment_sources=["rank 3 (env 0)"], episode_slots=1, group=None
    )
    segment = {"policy_version": torch.tensor([3, 3, 2])}
    assert trainer.check_policy_lag([segment], freshest=4, bound=2, iteration=4) == {
        "policy_lag_mean": pytest.approx(4 / 3),
        "policy_lag_max": 2.0,
    }
    with pytest.raises(PolicyLagError, match=r"rank 3 \(env 0\)"):
        trainer.check_policy_lag([segment], freshest=4, bound=1, iteration=4)
    with pytest.raises(PolicyLagError):  # a version newer than the freshest possible is a schedule bug as well
        trainer.check_policy_lag([{"policy_version": torch.tensor([5])}], freshest=4, bound=1, iteration=4)


def test_async_config_errors_exit_2_before_any_group(tmp_path):
    colocated = run_main("--config", TINY, f"run.dir={tmp_path / 'a'}", "engine.class=async")
    assert colocated.returncode == 2 and "split layout only" in colocated.stderr, colocated.stderr
    on_policy = run_main(
        "--config",
        TINY,
        f"run.dir={tmp_path / 'b'}",
        *SPLIT4,
        "engine.class=async",
        "engine.max_policy_lag=2",
        "--dry-run",
    )
    # --dry-run without a launcher is one process: the layout error comes first; ask the layout of 4 ranks instead
    assert on_policy.returncode == 2
    # Rank 0 of 4 started by hand: the plan is refused before any process group, so no peer is needed.
    lagged = run_main(
        "--config",
        TINY,
        f"run.dir={tmp_path / 'c'}",
        *SPLIT4,
        "engine.class=async",
        "engine.max_policy_lag=2",
        RANK="0",
        WORLD_SIZE="4",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="4",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        timeout=60,
    )
    assert lagged.returncode == 2, lagged.stderr[-2000:]
    assert "algo.vtrace=true" in lagged.stderr and "tolerates (0)" in lagged.stderr, lagged.stderr[-2000:]
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------------------------------------
# Failures


def _start_ranks(world: int, args: list[str]) -> list[subprocess.Popen]:
    """Ranks started by hand (RANK/WORLD_SIZE/MASTER_*): no torchrun agent stops the others, so the framework
    alone decides how the job ends."""
    port = _free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", "spmd_rl.main", *args],
            cwd=ROOT,
            env=with_pythonpath(rank_env(rank, world, port), ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_killed_or_stopped_env_rank_ends_the_async_job_within_the_timeout_naming_it(tmp_path, how):
    run_dir = tmp_path / "run"
    timeout_s = 15
    victim = 3  # rank 3: env 1
    procs = _start_ranks(
        5,
        [
            "--config",
            TINY,
            f"run.dir={run_dir}",
            "train.total_steps=10000000",
            "algo.update_epochs=1",
            *SPLIT5,
            *vtrace_at_lag(1),
            f"dist.timeout_s={timeout_s}",
        ],
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() or len(records(run_dir)) < 3:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
            time.sleep(0.2)
        procs[victim].send_signal(how)
        signalled_at = time.monotonic()
        outputs = {rank: p.communicate(timeout=3 * timeout_s + 30) for rank, p in enumerate(procs) if rank != victim}
        took = time.monotonic() - signalled_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert all(procs[rank].returncode != 0 for rank in outputs), [p.returncode for p in procs]
    assert took < 3 * timeout_s + 30
    # The ranks that talked to it (its inference rank, its trainer) name it; the rest follow from their errors.
    assert "rank 3 (env 1)" in outputs[0][1] + outputs[1][1], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    survivors = "".join(err for _, err in outputs.values())
    assert "communication error" in survivors
    print("\n".join(line for line in survivors.splitlines() if line.startswith("spmd_rl:")))


# ---------------------------------------------------------------------------------------------------------------
# V-trace


def test_vtrace_matches_a_hand_computed_example():
    # T = 3 steps of one env; pi/mu = 2, 0.5, 1; gamma = 0.9, lambda = 1, rho_bar = c_bar = 1:
    #   rho = c = [1, 0.5, 1];  V = [0.5, 1.0, 1.5], V(x_3) = 2.0;  r = [1, 0, 2]
    #   delta = [1*(1 + 0.9*1.0 - 0.5), 0.5*(0 + 0.9*1.5 - 1.0), 1*(2 + 0.9*2.0 - 1.5)] = [1.4, 0.175, 2.3]
    #   v_2 = 1.5 + 2.3 = 3.8
    #   v_1 = 1.0 + 0.175 + 0.9*0.5*2.3 = 2.21
    #   v_0 = 0.5 + 1.4 + 0.9*1*1.21 = 2.989
    #   A = [1*(1 + 0.9*2.21 - 0.5), 0.5*(0 + 0.9*3.8 - 1.0), 1*(2 + 0.9*2.0 - 1.5)] = [2.489, 1.21, 2.3]
    behaviour = torch.zeros(3, 1)
    target = torch.log(torch.tensor([[2.0], [0.5], [1.0]]))
    rewards = torch.tensor([[1.0], [0.0], [2.0]])
    values = torch.tensor([[0.5], [1.0], [1.5]])
    no = torch.zeros(3, 1, dtype=torch.bool)
    targets, advantages = vtrace(behaviour, target, rewards, values, torch.tensor([2.0]), no, no, gamma=0.9)
    assert torch.allclose(targets, torch.tensor([[2.989], [2.21], [3.8]]))
    assert torch.allclose(advantages, torch.tensor([[2.489], [1.21], [2.3]]))


def test_vtrace_stops_at_episode_ends_like_gae():
    # Step 0 terminates (no bootstrap), step 1 is the reset step, step 2 is truncated (bootstraps from V(final
    # obs) = the value of the step after it, here the next_value). Ratios 3 (truncated to 1) and 0.5.
    behaviour = torch.zeros(3, 1)
    target = torch.log(torch.tensor([[3.0], [1.0], [0.5]]))
    rewards = torch.tensor([[1.0], [0.0], [2.0]])
    values = torch.tensor([[0.5], [9.0], [1.5]])
    terminated = torch.tensor([[True], [False], [False]])
    truncated = torch.tensor([[False], [False], [True]])
    targets, advantages = vtrace(
        behaviour, target, rewards, values, torch.tensor([4.0]), terminated, truncated, gamma=0.9
    )
    # v_0 = 0.5 + 1*(1 - 0.5) = 1.0 (nothing flows back across the end);  A_0 = 1*(1 - 0.5) = 0.5
    # v_2 = 1.5 + 0.5*(2 + 0.9*4.0 - 1.5) = 3.55;  A_2 = 0.5*(2 + 0.9*4.0 - 1.5) = 2.05
    assert torch.allclose(targets[[0, 2]], torch.tensor([[1.0], [3.55]]))
    assert torch.allclose(advantages[[0, 2]], torch.tensor([[0.5], [2.05]]))


def test_vtrace_on_policy_gives_gae_returns():
    torch.manual_seed(0)
    t, n = 7, 3
    rewards, values, next_value = torch.randn(t, n), torch.randn(t, n), torch.randn(n)
    terminated, truncated = torch.rand(t, n) < 0.2, torch.rand(t, n) < 0.1
    log_prob = torch.randn(t, n)
    targets, advantages = vtrace(
        log_prob, log_prob, rewards, values, next_value, terminated, truncated, gamma=0.95, lam=0.8
    )
    gae, returns = compute_gae(rewards, values, next_value, terminated, truncated, 0.95, 0.8)
    assert torch.allclose(targets, returns, atol=1e-6)
    # With lambda = 1 the policy-gradient advantage is the one-step-ahead V-trace return minus V.
    targets1, advantages1 = vtrace(
        log_prob, log_prob, rewards, values, next_value, terminated, truncated, gamma=0.95, lam=1.0
    )
    _, returns1 = compute_gae(rewards, values, next_value, terminated, truncated, 0.95, 1.0)
    assert torch.allclose(advantages1, returns1 - values, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# A user's algorithm declares the lag it tolerates


LAGGY_ALGORITHM = '''
"""A user's algorithm: one REINFORCE-with-baseline step per iteration, declaring that it tolerates lag 2."""
from dataclasses import dataclass
from typing import ClassVar

import torch

from spmd_rl.api import Algorithm, AlgorithmConfig, Schedule


@dataclass
class Config(AlgorithmConfig):
    default_policy: ClassVar[str] = "actor_critic"
    learning_rate: float = 1e-3
    update_epochs: int = 1  # keys of ci_tiny's algo section
    num_minibatches: int = 1


class LaggyReinforce(Algorithm):
    Config = Config
    requires = ("log_prob", "value")
    policy_methods = ("evaluate", "value")

    @classmethod
    def schedule(cls, config):
        return Schedule(max_policy_lag=2)

    def __init__(self, policy, config, context):
        super().__init__(policy, config, context)
        self.model = context.data_parallel(policy)
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=config.learning_rate)

    def learn(self, segment, iteration):
        rollout = segment["rollout"].reshape(-1)
        valid = rollout["valid"]
        log_prob, entropy, value = self.model(rollout["obs"], rollout["action"])
        ret = rollout["reward"]
        advantage = (ret - value).detach()
        loss = (-(log_prob * advantage) + (value - ret).square())[valid].mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss)}
'''


def test_a_plugin_algorithm_that_declares_its_lag_runs_async(tmp_path):
    (tmp_path / "laggy.py").write_text(textwrap.dedent(LAGGY_ALGORITHM))
    run_dir = tmp_path / "run"
    result = run_main(
        "--config",
        TINY,
        f"run.dir={run_dir}",
        "algo.class=laggy:LaggyReinforce",
        "train.total_steps=1440",
        *SPLIT5,
        "engine.class=async",
        nproc=5,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max policy lag 2" in result.stdout
    lags = [r["policy_lag_max"] for r in records(run_dir)]
    assert len(lags) == 15 and max(lags) <= 2


@pytest.mark.slow
def test_a_user_engine_adds_a_metric_and_its_state_under_either_engine(tmp_path):
    """examples/engine_metric: one mix-in over the hooks every engine has; under the sync engine (one process)
    and the async one (split), every line gains its metrics, and a stopped run resumes its engine's own state."""
    example = ROOT / "examples" / "engine_metric"
    for engine, layout, nproc in (("SyncWeightNorm", (), 0), ("AsyncWeightNorm", SPLIT4, 4)):
        common = ("--config", TINY, *layout, f"engine.class=weight_norm:{engine}")
        full = run_main(*common, f"run.dir={tmp_path / engine / 'full'}", nproc=nproc, cwd=example)
        assert full.returncode == 0, full.stderr[-3000:]
        parts = (*common, f"run.dir={tmp_path / engine / 'parts'}")
        stopped = run_main(*parts, "run.stop_after_iterations=2", nproc=nproc, cwd=example)
        assert stopped.returncode == 75, stopped.stderr[-3000:]
        state = torch.load(tmp_path / engine / "parts" / "checkpoints" / "iter_000000001" / "rank0.pt")
        assert state["largest_norm"]["value"] > 0, "the engine's own component is in the checkpoint"
        resumed = run_main(*parts, nproc=nproc, cwd=example)
        assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
        lines = records(tmp_path / engine / "full")
        norms = [r["weight_norm"] for r in lines]
        assert [r["weight_norm_max"] for r in lines] == [max(norms[: i + 1]) for i in range(len(norms))]
        assert learning_records(tmp_path / engine / "parts") == learning_records(tmp_path / engine / "full")
