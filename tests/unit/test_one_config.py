"""`--config` given twice is refused: the second silently replaced the first, where a user may expect the two merged
(fault pass 8, N4)."""

from __future__ import annotations

import pytest

from spmd_rl.main import parse_args


def test_a_second_config_is_refused_naming_both(capsys):
    with pytest.raises(SystemExit) as ended:
        parse_args(["--config", "a.yaml", "--config", "b.yaml", "train.seed=2"])
    assert ended.value.code == 2
    assert "--config given twice (a.yaml, then b.yaml): configs are not merged" in capsys.readouterr().err


def test_one_config_and_its_overrides_are_read_as_before():
    args = parse_args(["--config", "a.yaml", "train.seed=2"])
    assert args.config == "a.yaml" and args.overrides == ["train.seed=2"]


def test_overrides_on_both_sides_of_an_option_are_all_read():
    # fault pass 9, CLI1: `train.total_steps=64 --config F run.dir=X` was "unrecognized arguments: run.dir=X", exit 2
    from spmd_rl.sweep import parse_args as sweep_args

    args = parse_args(["train.total_steps=64", "--config", "a.yaml", "run.dir=x"])
    assert args.config == "a.yaml" and args.overrides == ["train.total_steps=64", "run.dir=x"]
    sweep = sweep_args(["--config", "a.yaml", "train.total_steps=64", "--root", "r", "train.seed=1,2"])
    assert sweep.overrides == ["train.total_steps=64", "train.seed=1,2"]
