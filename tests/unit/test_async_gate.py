"""The async inference server's lag gate, without a process group: which env ranks it serves with the weights it
holds (lockstep at lag 0, the lag bound otherwise), when it may swap in a newer broadcast, when an iteration counts
as served, and the segment check on every observation. The server is built from in-process channels and a stand-in
weight sync; its state (`ready`, `next_step`, `policy_version`) is set directly."""

from __future__ import annotations

import datetime

import pytest
import torch
from harness.parts import receiving_weight_sync
from tensordict import TensorDict
from torch import nn

from spmd_rl.comm.local_channel import local_channel
from spmd_rl.engines.asynchronous.serving_threads import AsyncInferenceServer
from spmd_rl.interfaces.policy import StepField
from spmd_rl.roles.inference_server import InferenceParts
from spmd_rl.roles.messages import action_message
from spmd_rl.run.plan import Plan
from spmd_rl.runtime.errors import CommError

NUM_ENVS = 2  # envs per env rank
OBS = 3


class TinyPolicy(nn.Module):
    """Acts with action = 100 * obs[:, 0] (so a reply shows which observation it answers)."""

    def outputs(self) -> dict[str, StepField]:
        return {"action": StepField((), torch.int64)}

    def act(self, obs: torch.Tensor, deterministic: bool = False) -> dict[str, torch.Tensor]:
        return {"action": (100 * obs[:, 0]).to(torch.int64)}


class FakeStaged:
    """A staged broadcast of `version` that is complete; records swaps and posts."""

    def __init__(self, version: int):
        self._version = version
        self.swapped = 0
        self.posted = 0

    def version(self) -> int:
        return self._version

    def swap(self) -> int:
        self.swapped += 1
        return self._version

    def post(self) -> None:
        self.posted += 1


def make_plan(num_steps: int = 2, sync_every: int = 1, num_iterations: int = 4) -> Plan:
    return Plan(
        env_ranks=2,
        trainer_ranks=1,
        envs_total=2 * NUM_ENVS,
        num_steps=num_steps,
        steps_per_iteration=2 * NUM_ENVS * num_steps,
        num_iterations=num_iterations,
        max_env_columns_per_trainer=2 * NUM_ENVS,
        sync_every=sync_every,
        explore_iterations=0,
    )


def make_server(plan: Plan, lag_bound: int, iterations: range, env_ranks: int = 2):
    """The server (inference rank 1, weights from rank 0, env ranks 2, 3, ...) and the env ends of its channels."""
    policy = TinyPolicy()
    obs_ends = [local_channel("observations", observation(0)) for _ in range(env_ranks)]
    action_ends = [local_channel("actions", action_message(policy.outputs(), NUM_ENVS)) for _ in range(env_ranks)]
    parts = InferenceParts(
        policy=policy,
        weight_sync=receiving_weight_sync(timeout_s=5),
        obs_channels=[receive for _, receive in obs_ends],
        action_channels=[send for send, _ in action_ends],
        uniform_actions=None,
        client_names=[f"rank {rank}" for rank in range(2, 2 + env_ranks)],
    )
    server = AsyncInferenceServer(
        parts,
        plan,
        lag_bound,
        iterations,
        torch.device("cpu"),
        datetime.timedelta(seconds=5),
        verify_every=0,
        describe_rank=lambda rank: f"rank {rank}",
        rank=1,
    )
    return server, [receive for _, receive in action_ends]


def observation(segment: int, value: float = 0.0) -> TensorDict:
    return TensorDict(
        {"obs": torch.full((NUM_ENVS, OBS), value), "segment": torch.tensor([segment], dtype=torch.int64)},
        batch_size=[],
    )


def test_construction_starts_every_env_rank_at_the_first_step_with_no_weights():
    plan = make_plan(num_steps=3, sync_every=2, num_iterations=8)
    server, _ = make_server(plan, lag_bound=1, iterations=range(2, 8))
    assert server.next_step == [6, 6]
    assert server.end_step == 24
    assert server.syncs == [3, 5, 7]  # broadcasts after iterations 3, 5, 7 (sync_every=2)
    assert server.policy_version == -1 and server.taken == 0 and not server.lockstep
    assert server.env_names == ["rank 2", "rank 3"] and server.source == "rank 0"
    assert server.staged.posted == 0  # StagedWeights built, nothing posted


def test_required_version_is_the_segments_version_less_the_lag_bound():
    plan = make_plan(sync_every=2, num_iterations=10)
    server, _ = make_server(plan, lag_bound=0, iterations=range(10))
    assert [server.required_version(s) for s in range(6)] == [0, 0, 1, 1, 2, 2]
    server, _ = make_server(plan, lag_bound=2, iterations=range(10))
    assert [server.required_version(s) for s in range(6)] == [-2, -2, -1, -1, 0, 0]


def test_lag_zero_serves_all_env_ranks_or_none():
    server, _ = make_server(make_plan(), lag_bound=0, iterations=range(4))
    assert server.lockstep
    server.policy_version = 0
    server.ready = {1: observation(0)}
    assert server._servable() == []  # one of two ready: wait for the other
    server.ready = {1: observation(0), 0: observation(0)}
    assert server._servable() == [0, 1]  # both, in the fixed order
    server.policy_version = -1
    assert server._servable() == []  # no weights yet
    # Segment 1 needs version 1 (sync_every=1); version 0 serves neither, not one.
    server.next_step = [2, 2]
    server.policy_version = 0
    assert server._servable() == []
    server.policy_version = 1
    assert server._servable() == [0, 1]


def test_lag_bound_holds_back_only_the_env_rank_too_far_ahead():
    server, _ = make_server(make_plan(num_iterations=6), lag_bound=2, iterations=range(6))
    server.next_step = [6, 4]  # segments 3 and 2: they need versions 1 and 0
    server.policy_version = 0
    server.ready = {0: observation(3), 1: observation(2)}
    assert server._servable() == [1]  # rank 0 waits for version 1, rank 1 is served alone
    server.ready = {0: observation(3)}
    assert server._servable() == []
    server.policy_version = 1
    assert server._servable() == [0]  # not lockstep: one ready env rank is served by itself
    server.ready = {1: observation(2), 0: observation(3)}
    assert server._servable() == [0, 1]
    server.ready = {}
    assert server._servable() == []


def test_may_take_waits_for_env_ranks_acting_for_older_segments():
    server, _ = make_server(make_plan(), lag_bound=2, iterations=range(4))
    server.next_step = [2, 6]  # segments 1 and 3: versions 1 and 3
    assert server._may_take(1)
    assert not server._may_take(2)  # rank 0 still acts for segment 1 (version 1)
    server.next_step = [4, 6]  # segments 2 and 3
    assert server._may_take(2) and not server._may_take(3)
    server.next_step = [8, 6]  # rank 0 is done (end_step 8): only rank 1 counts
    assert server._may_take(3) and not server._may_take(4)
    server.next_step = [8, 8]  # everyone is done: any version may be taken
    assert server._may_take(99)


def test_served_through_needs_every_step_every_broadcast_and_no_server():
    server, _ = make_server(make_plan(sync_every=2), lag_bound=1, iterations=range(4))
    assert server.syncs == [1, 3]
    server.next_step = [2, 2]
    assert server._served_through(0)  # iteration 0 is served and no broadcast is due by then
    assert not server._served_through(1)
    server.next_step = [4, 3]
    assert not server._served_through(1)  # rank 1 has one step of segment 1 left
    server.next_step = [4, 4]
    assert not server._served_through(1)  # the broadcast after iteration 1 is not taken yet
    server.taken = 1
    assert server._served_through(1)
    server.serving = True
    assert not server._served_through(1)  # a thread is still serving
    server.serving = False
    server.next_step = [8, 8]
    assert not server._served_through(3) and server._served_through(2)
    server.taken = 2
    assert server._served_through(3)


def test_check_segment_refuses_an_observation_of_another_segment():
    server, _ = make_server(make_plan(num_steps=3), lag_bound=1, iterations=range(4))
    server.next_step = [3, 5]  # both in segment 1
    server._check_segment(0, observation(1))
    server._check_segment(1, observation(1))
    with pytest.raises(
        CommError,
        match=r"rank 1: observations from rank 3 are of segment 2, expected segment 1 "
        r"\(step 5\); the ranks' schedules differ",
    ):
        server._check_segment(1, observation(2))
    with pytest.raises(CommError, match="rank 2 are of segment 0, expected segment 1"):
        server._check_segment(0, observation(0))


def test_serving_defers_a_newer_broadcast_until_the_lagging_env_rank_finished_its_segment():
    """Resumed at iteration 1 of 2 (one broadcast left, after iteration 1): rank 0 has one step of segment 1 to
    go, rank 1 is done. Version 2 is staged and complete, but rank 0's last step must still get version 1; only
    then is version 2 swapped in."""
    plan = make_plan(num_steps=2, sync_every=1, num_iterations=2)
    server, replies = make_server(plan, lag_bound=1, iterations=range(1, 2))
    assert server.syncs == [1] and server.end_step == 4
    server.staged = FakeStaged(version=2)
    server.policy_version = 1
    server.next_step = [3, 4]
    server.weights_complete = True
    server.ready = {0: observation(1, value=7.0)}
    server._serve_while_possible()
    reply = replies[0].recv()
    assert int(reply["policy_version"][0]) == 1  # acted with the old weights
    assert reply["action"].tolist() == [700] * NUM_ENVS  # with the policy, for that observation
    assert server.next_step == [4, 4] and server.ready == {}
    assert server.staged.swapped == 1 and server.policy_version == 2 and server.taken == 1
    assert not server.weights_complete and not server.serving
    assert server.staged.posted == 0  # no broadcast left to post
    assert server._served_through(1)
    with pytest.raises(RuntimeError, match="receive with no message sent"):
        replies[1].recv()  # rank 1 was done: nothing was sent to it


def test_serving_in_lockstep_waits_for_every_env_rank_then_answers_each():
    server, replies = make_server(make_plan(), lag_bound=0, iterations=range(4))
    server.policy_version = 0
    server.ready = {1: observation(0, value=2.0)}
    server._serve_while_possible()
    assert server.next_step == [0, 0] and list(server.ready) == [1] and not server.serving
    server.ready[0] = observation(0, value=1.0)
    server._serve_while_possible()
    assert server.next_step == [1, 1] and server.ready == {}
    assert [r.recv()["action"].tolist() for r in replies] == [[100] * NUM_ENVS, [200] * NUM_ENVS]


def test_a_reply_goes_out_only_after_its_step_is_counted():
    """The env rank's next observation can arrive the moment its reply is sent, and its receiving thread checks it
    against next_step: counting after the send let that check see the old step under load ("observations ... are of
    segment 26, expected segment 25"), a rare failure of the async CI tests."""
    server, _ = make_server(make_plan(num_steps=2), lag_bound=1, iterations=range(4))
    server.policy_version = 0
    server.next_step = [1, 0]  # rank 0's next step, 1, is the last of segment 0
    counted_at_send = []
    for index, channel in enumerate(server.action_channels):
        send = channel.isend

        def counted_send(index=index, send=send):
            counted_at_send.append((index, server.next_step[index]))
            server._check_segment(index, observation(server.next_step[index] // 2))  # the next one may be here
            send()

        channel.isend = counted_send
    server.ready = {0: observation(0), 1: observation(0)}
    server._serve_while_possible()
    assert counted_at_send == [(0, 2), (1, 1)]
    server._check_segment(0, observation(1))  # rank 0's next observation is of segment 1, as the server expects
