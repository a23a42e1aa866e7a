"""UpdateGuard around a tiny algorithm: a NaN update is an error naming the iteration, or (skip) undone exactly —
parameters, attribute tensors and Adam's state — and counted; a finite update passes untouched; a parameter norm
that overflows while every value is finite is not a problem."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from spmd_rl.roles.update_guard import SKIPPED_METRIC, UpdateGuard
from spmd_rl.runtime.errors import UserCodeError

# The first optimizer built imports torch._dynamo (about a second): pay it at collection, not in the first test.
torch.optim.Adam([torch.zeros(1, requires_grad=True)])


class TinyAlgorithm:
    """policy = nn.Linear(3, 2) and a temperature tensor, both trained by one Adam. learn(segment, iteration): one
    step on `segment` (an input batch); `bad` makes it "nan_loss" (a finite step, a NaN loss reported),
    "nan_weights" (a NaN gradient: NaN weights, no loss reported) or "" (finite)."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.policy = nn.Linear(3, 2)
        self.log_alpha = torch.zeros(1, requires_grad=True)
        self.optimizer = torch.optim.Adam([*self.policy.parameters(), self.log_alpha], lr=0.1)
        self.bad = ""

    def learn(self, segment: torch.Tensor, iteration: int) -> dict[str, float]:
        loss = self.policy(segment).pow(2).mean() + self.log_alpha.exp().sum()
        if self.bad == "nan_weights":
            loss = loss * float("nan")
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if self.bad == "nan_weights":
            return {"grad_steps": 1.0}  # no loss metric: the guard must find it in the parameters
        return {"loss": float("nan") if self.bad == "nan_loss" else loss.item(), "grad_steps": 1.0}


def batch(i: int) -> torch.Tensor:
    return torch.randn(8, 3, generator=torch.Generator().manual_seed(100 + i))


def tensors(algorithm: TinyAlgorithm) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in algorithm.policy.state_dict().items()}
    state["log_alpha"] = algorithm.log_alpha.detach().clone()
    return state


def optimizer_state(algorithm: TinyAlgorithm) -> dict:
    state = algorithm.optimizer.state_dict()["state"]
    return {
        index: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for index, entry in state.items()
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_same(a[key], b[key])
        else:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("nan_loss", r"a non-finite loss \(loss=nan\)"),
        ("nan_weights", r"non-finite policy parameters \(weight, bias\)"),
    ],
)
def test_without_skip_a_nonfinite_update_is_an_error_naming_the_iteration(bad, problem):
    algorithm = TinyAlgorithm()
    guard = UpdateGuard(algorithm, skip=False, describe="rank 0 (trainer 0)")
    guard.learn(batch(0), 6)
    algorithm.bad = bad
    with pytest.raises(
        UserCodeError,
        match=rf"rank 0 \(trainer 0\): the update of iteration 7 produced "
        rf"{problem}[^;]*; .*train.skip_nonfinite_updates=true",
    ):
        guard.learn(batch(1), 7)


@pytest.mark.parametrize("bad", ["nan_loss", "nan_weights"])
def test_skip_restores_parameters_and_optimizer_state_exactly_and_counts(bad):
    guarded, reference = TinyAlgorithm(), TinyAlgorithm()  # same seed: the reference never sees a bad update
    guard = UpdateGuard(guarded, skip=True, describe="rank 0")
    assert guard.learn(batch(0), 0)[SKIPPED_METRIC] == 0.0
    reference.learn(batch(0), 0)
    params, adam = tensors(guarded), optimizer_state(guarded)
    assert int(adam[0]["step"]) == 1

    guarded.bad = bad
    for count in (1, 2):
        metrics = guard.learn(batch(1), count)
        assert metrics[SKIPPED_METRIC] == float(count) and guard.skipped == count
        assert metrics["grad_steps"] == 1.0  # the algorithm's own metrics are passed on
        assert_same(tensors(guarded), params)
        assert_same(optimizer_state(guarded), adam)  # step count and both moments, not only weights

    guarded.bad = ""
    for i in (2, 3):  # later updates are those of a run without the bad one
        metrics = guard.learn(batch(i), i)
        reference.learn(batch(i), i)
        assert math.isfinite(metrics["loss"]) and metrics[SKIPPED_METRIC] == 2.0
    assert_same(tensors(guarded), tensors(reference))
    assert_same(optimizer_state(guarded), optimizer_state(reference))


@pytest.mark.parametrize("skip", [False, True])
def test_a_finite_update_passes_through_untouched(skip):
    guarded, reference = TinyAlgorithm(), TinyAlgorithm()
    guard = UpdateGuard(guarded, skip=skip, describe="rank 0")
    for i in range(3):
        metrics = guard.learn(batch(i), i)
        expected = reference.learn(batch(i), i)
        assert metrics == ({**expected, SKIPPED_METRIC: 0.0} if skip else expected)
    assert_same(tensors(guarded), tensors(reference))
    assert_same(optimizer_state(guarded), optimizer_state(reference))
    assert guard.skipped == 0


@pytest.mark.parametrize("skip", [False, True])
def test_an_overflowing_norm_of_finite_weights_is_not_a_problem(skip):
    algorithm = TinyAlgorithm()
    with torch.no_grad():
        for p in algorithm.policy.parameters():
            p.fill_(1e38)
    for p in algorithm.policy.parameters():
        p.requires_grad_(False)  # learn() changes only the temperature
    parameters = list(algorithm.policy.parameters())
    assert not torch.isfinite(torch.nn.utils.get_total_norm(parameters, foreach=True))  # the norm does overflow
    assert all(bool(torch.isfinite(p).all()) for p in parameters)
    guard = UpdateGuard(algorithm, skip=skip, describe="rank 0")
    alpha_before = algorithm.log_alpha.detach().clone()

    def learn(segment, iteration):
        with torch.no_grad():
            algorithm.log_alpha.add_(0.5)
        return {"loss": 1.0}

    algorithm.learn = learn
    metrics = guard.learn(batch(0), 0)
    assert metrics["loss"] == 1.0 and guard.skipped == 0
    assert torch.equal(algorithm.log_alpha.detach(), alpha_before + 0.5)  # the update was kept
    assert all(bool((p == 1e38).all()) for p in parameters)


@pytest.mark.parametrize("sharded", [False, True])
def test_the_error_advises_skipping_only_where_skipping_is_allowed(sharded):
    # fault pass 7, NL2: under train.parallel=fsdp the line advised train.skip_nonfinite_updates=true, which
    # run/plan.py refuses with fsdp ("each trainer sees only its shards of the weights")
    algorithm = TinyAlgorithm()
    algorithm.bad = "nan_loss"
    guard = UpdateGuard(algorithm, skip=False, describe="trainer", sharded=sharded)
    with pytest.raises(UserCodeError) as error:
        guard.learn(batch(0), 2)
    assert "fix the algorithm or its settings" in str(error.value)
    assert ("skip_nonfinite_updates" in str(error.value)) is not sharded, str(error.value)
