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
