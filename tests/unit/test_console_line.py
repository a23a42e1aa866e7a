"""The console's periodic line says what it knows: before the first episode ends there is no return to show (the
mean of no returns is NaN), and it says so instead of printing "return nan"."""

import torch

from spmd_rl.run.metrics import MetricsLogger


def _record(episodes: int, mean_return: float, mean_length: float) -> dict:
    return {
        "iteration": 3,
        "env_steps": 512,
        "episodes": episodes,
        "episode_return_mean": mean_return,
        "episode_length_mean": mean_length,
        "sps": 1234.0,
    }


def test_before_the_first_episode_ends_the_line_says_so():
    line = MetricsLogger.line(_record(0, float("nan"), float("nan")))
    assert "nan" not in line
    assert line == "iter     3  steps       512  no episode has ended yet  sps     1234"


def test_after_episodes_the_line_shows_their_mean_return_and_length():
    line = MetricsLogger.line(_record(4, 21.5, 21.5))
    assert line == "iter     3  steps       512  return    21.50  len    21.5  sps     1234"


def test_an_env_group_whose_first_episode_has_not_ended_shows_a_dash():
    record = {**_record(4, 21.5, 21.5), "episode_return_mean/easy": 30.0, "episode_return_mean/hard": float("nan")}
    line = MetricsLogger.line(record)
    assert "nan" not in line
    assert line.endswith("(easy 30.0 hard -)")


def test_an_evaluation_is_printed_on_its_iteration_whatever_log_interval_s(tmp_path, capsys):
    # DQN and TD3 make many short iterations: with one line every interval_s their evaluations never showed
    logger = MetricsLogger(tmp_path, total_steps=1000, progress=False, interval_s=3600.0, tensorboard=False)
    base = {**_record(4, 21.5, 21.5), "wall_s": 0.0}
    logger.write({**base, "iteration": 0, "wall_s": 0.0})
    logger.write({**base, "iteration": 1, "wall_s": 1.0})
    logger.write({**base, "iteration": 2, "wall_s": 2.0, "eval_return_mean": 500.0, "eval_return_std": 0.0})
    logger.close(summary=False)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["0", "2"], lines
    assert lines[1].endswith("eval 500.00 ± 0.00"), lines[1]


def test_an_iteration_with_no_ended_episode_shows_its_success_as_a_dash():
    record = {**_record(4, 21.5, 21.5), "success_rate": float("nan")}
    assert MetricsLogger.line(record).endswith("success -")
    assert MetricsLogger.line({**record, "success_rate": 0.5}).endswith("success 0.50")


def test_a_run_without_rollouts_shows_its_loss_and_evaluation_not_env_steps(tmp_path, capsys):
    # bc: no env steps, no episodes, no rollout timings; its line is the update and the evaluation
    logger = MetricsLogger(tmp_path, total_steps=0, progress=False, interval_s=0.0, tensorboard=False, rollouts=False)
    statistics = {
        "returns": torch.zeros(0),
        "lengths": torch.zeros(0),
        "env_ranks": 1.0,
        **{key: torch.tensor(3.0) for key in ("env_s", "inference_s", "action_wait_s", "rollout_s")},
        "inference_idle_s": torch.tensor(3.0),
    }
    record = logger.record(7, 0, {"nll_loss": -1.25}, statistics, {"time_learn_s": 2.5})
    assert not any(key in record for key in ("time_env_s", "time_rollout_s", "time_env_idle_s")), record
    logger.write({**record, "eval_return_mean": 300.0, "eval_return_std": 10.0, "eval_success_rate": 0.92})
    logger.close(summary=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "iter     7  learn 2.500s  nll -1.250  eval 300.00 ± 10.00 success 0.92", lines
    assert lines[1].startswith("done: 8 iterations (no rollouts), this process's in "), lines
