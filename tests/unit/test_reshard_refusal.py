"""A resume on another layout that cannot reshard is refused with one line that says what to change: the layout
keys whose values differ from the checkpoint's (with the values to set) and the number of ranks, not only that
they are blockers."""

import pytest

from spmd_rl.config.loading import load_config
from spmd_rl.persist.checkpoint import CheckpointStore
from spmd_rl.persist.run_files import CONFIG_FILE
from spmd_rl.run.resume import decide_resume
from spmd_rl.runtime.errors import UserError


def _checkpoint_of(run_dir, overrides, ranks):
    previous = load_config(None, overrides)
    run_dir.mkdir()
    (run_dir / CONFIG_FILE).write_text(previous.to_yaml())
    store = CheckpointStore(run_dir)
    for rank in range(ranks):
        store.save({"iteration": 1}, 1, rank)
    store.commit(1, world_size=ranks)


def test_the_refusal_names_the_layout_keys_and_rank_count_to_resume_with(tmp_path):
    run_dir = tmp_path / "run"
    _checkpoint_of(run_dir, [], ranks=2)  # colocated, 2 ranks, DDP
    split = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=1"]
    with pytest.raises(UserError) as refused:
        decide_resume(load_config(None, split), run_dir, world_size=3)
    message = str(refused.value)
    assert "resume with the checkpoint's layout: set layout.mode=colocated and start 2 ranks" in message, message
    assert "layout.trainer" not in message.split("set ")[1], "split's own counts need no change on colocated"


def test_the_same_layout_on_another_rank_count_asks_only_for_the_rank_count(tmp_path):
    run_dir = tmp_path / "run"
    _checkpoint_of(run_dir, [], ranks=2)
    with pytest.raises(UserError) as refused:
        decide_resume(load_config(None, []), run_dir, world_size=1)
    assert "resume with the checkpoint's layout: start 2 ranks" in str(refused.value), str(refused.value)
