"""algo.num_minibatches against what a trainer learns from per iteration: more parts than there are samples,
decisions or sequences is one line naming the key, said alike by every algorithm that splits its batch."""

import pytest

from spmd_rl.algorithms.configs import GRPOConfig, PPOConfig
from spmd_rl.algorithms.grpo import GRPO
from spmd_rl.algorithms.ppo import PPO
from spmd_rl.algorithms.recurrent_ppo import RecurrentPPO, RecurrentPPOConfig
from spmd_rl.interfaces.algorithm import PlanFacts
from spmd_rl.runtime.errors import UserError

SAMPLES = 64  # per trainer and iteration


def facts() -> PlanFacts:
    return PlanFacts(1, 1, SAMPLES, SAMPLES, 3, group_size=2)


# algorithm, its config with num_minibatches=N, the most minibatches it takes, what it says beyond that
CASES = {
    "ppo": (PPO, lambda n: PPOConfig(num_minibatches=n), SAMPLES, "64 samples a trainer holds per iteration; lower it"),
    "grpo": (
        GRPO,
        lambda n: GRPOConfig(num_minibatches=n),
        SAMPLES,
        "64 decisions a trainer holds per iteration; lower it",
    ),
    "recurrent_ppo": (  # whole sequences: 64 samples of 16 steps are 4 env columns
        RecurrentPPO,
        lambda n: RecurrentPPOConfig(num_steps=16, num_minibatches=n),
        SAMPLES // 16,
        "4 env columns (whole sequences) a trainer learns from per iteration; lower it or raise env.num_envs",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_more_minibatches_than_a_trainer_holds_is_one_line_naming_the_key(name):
    algorithm, config, most, said = CASES[name]
    algorithm.check_plan(config(most), facts())  # as many as there are: accepted
    with pytest.raises(UserError) as error:
        algorithm.check_plan(config(most + 1), facts())
    assert str(error.value) == f"algo.num_minibatches={most + 1} is more than the {said}"
