"""Memory checked before start: a policy whose weights, gradients and Adam state cannot fit this host, or an
off-policy batch that cannot, is refused with the key to lower, before training allocates any of it. The per-rank
estimate divides over shards for FSDP."""

from __future__ import annotations

import pytest

from spmd_rl.config.loading import load_config
from spmd_rl.run.driver import resolve
from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.launch import LaunchInfo
from spmd_rl.runtime.limits import training_state_bytes

ONE_PROCESS = LaunchInfo("none", rank=0, world_size=1, local_rank=0, local_world_size=1, init_method="")


HUGE_POLICY = """
import torch
from torch import nn

from spmd_rl.modules.actor_critic import ActorCritic


class HugePolicy(ActorCritic):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # 2 x 10^10 parameters held in 4 bytes (a stride-0 view): a policy that training could never fit (320 GB of
        # weights, gradients and Adam state), built here at no cost
        self.table = nn.Parameter(torch.zeros(1).expand(20_000_000_000))
"""


def test_a_policy_too_large_for_the_host_is_refused_before_training_allocates(tmp_path, monkeypatch):
    (tmp_path / "huge_policy.py").write_text(HUGE_POLICY)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["policy.class=huge_policy:HugePolicy", "env.num_envs=1"])
    with pytest.raises(
        UserError,
        match=r"\(20,000,00[0-9,]+ parameters: weights, gradients and Adam's moments, 16 bytes each.*"
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
