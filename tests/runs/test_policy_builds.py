"""Where the policy is built (finished.json's "ranks"): once on every rank that acts or trains with it, never on an
env rank; when the trainers shard it under PPO, once on trainer 0 only: the others build it on the meta device and
take their shards' values from trainer 0's (rank 0's unsharded copy for policy.pt is no second construction); the
checks before start read an instance on the meta device. Env ranks never import the policy's module: what the
building ranks' checks found reaches them once the process group exists, a refusal too."""

from __future__ import annotations

import json

from harness.runs import TINY, assert_one_line_exit_2, assert_run_complete, run_main

from spmd_rl.persist.run_files import FINISHED


def ranks_of(run_dir) -> list[dict]:
    return json.loads((run_dir / FINISHED).read_text())["ranks"]


def test_a_split_run_builds_the_policy_on_trainer_0_and_the_inference_rank_and_never_on_env_ranks(tmp_path):
    result = run_main(
        "--config", TINY, f"run.dir={tmp_path}", "train.parallel=fsdp", "layout.mode=split", "layout.trainer=2",
        "layout.inference=1", "layout.env=2",
        nproc=5,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = ranks_of(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3, 4]
    builds = {
        role: [r["policy_builds"] for r in ranks if r["role"] == role] for role in ("trainer", "inference", "env")
    }
    assert builds == {"trainer": [1, 0], "inference": [1], "env": [0, 0]}, ranks
    assert all(r["peak_rss_mb"] > 0 for r in ranks)


def test_one_process_builds_the_policy_once(tmp_path):
    result = run_main("--config", TINY, f"run.dir={tmp_path}")
    assert_run_complete(result, tmp_path, iterations=8)
    (rank,) = ranks_of(tmp_path)
    assert rank["rank"] == 0 and rank["role"] == "colocated" and rank["policy_builds"] == 1


def test_a_policy_acting_on_the_wrong_action_shape_is_refused_by_every_rank_of_a_split_layout(tmp_path):
    # Only the trainer and inference ranks check the policy; the env rank, which never imports it, refuses with them.
    result = run_main(
        "--config", TINY, f"run.dir={tmp_path}", "env.id=Pendulum-v1",
        "policy.class=tests.harness.chunk_policy:ChunkDeclaringActorCritic", "layout.mode=split", "layout.trainer=1",
        "layout.inference=1", "layout.env=1",
        nproc=3,
    )  # fmt: skip
    assert_one_line_exit_2(result, "declares 'action' of shape (4, 1)", "takes actions of shape (1,)")


def test_a_policy_whose_act_fails_is_refused_by_every_rank_of_a_split_layout_before_any_iteration(tmp_path):
    # Rank 0 calls act on the instance it then trains with (run/contract.py's check_calls), before start.
    result = run_main(
        "--config", TINY, f"run.dir={tmp_path}", "policy.class=tests.harness.chunk_policy:ActFailingActorCritic",
        "layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=1",
        nproc=3,
    )  # fmt: skip
    assert_one_line_exit_2(result, "act(obs, deterministic=False) failed", "act is broken on purpose")
    assert not (tmp_path / "metrics.jsonl").exists()
