"""Memory checked before start: a policy whose weights, gradients and Adam state cannot fit this host, or an
off-policy batch that cannot, is refused with the key to lower, counted without allocating (the policy is built on
the meta device first). The per-rank estimate divides over shards for FSDP."""

from __future__ import annotations

import pytest

from spmd_rl.config.loading import load_config
from spmd_rl.run.driver import resolve
from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.launch import LaunchInfo
from spmd_rl.runtime.limits import training_state_bytes

ONE_PROCESS = LaunchInfo("none", rank=0, world_size=1, local_rank=0, local_world_size=1, init_method="")


def test_a_policy_too_large_for_the_host_is_refused_before_it_is_built():
    # 2 x 10^10 parameters: 320 GB to train, more than any host these tests run on; building it would need 80 GB.
    cfg = load_config(None, ["policy.hidden_sizes=[100000,100000]", "env.num_envs=1"])
    with pytest.raises(
        UserError,
        match=r"\(20,001,600,004 parameters: weights, gradients and Adam's moments, 16 bytes each.*"
        r"lower policy.hidden_sizes",
    ):
        resolve(cfg, ONE_PROCESS, dry_run=False)


def test_an_off_policy_batch_too_large_for_the_host_is_refused_naming_algo_batch_size():
    cfg = load_config("configs/sac_pendulum.yaml", ["algo.batch_size=10000000000"])
    with pytest.raises(UserError, match="a sampled batch of a trainer .* lower algo.batch_size"):
        resolve(cfg, ONE_PROCESS, dry_run=False)


def test_the_training_state_estimate_divides_over_shards():
    assert training_state_bytes(1000) == 16_000
    assert training_state_bytes(1000, shards=8) == 2_000
    assert training_state_bytes(1001, shards=8) == 2_002  # rounded up
