"""spmd_rl.plot reads a metrics.jsonl with a damaged line as one UserError naming the line (or skips it when it is the
last, torn by a kill): a line of deeply nested brackets was a RecursionError traceback and a line holding a bare
JSON value (`42`) an AttributeError one (fault pass 6, R2; python -m spmd_rl.runs already lists such runs)."""

from __future__ import annotations

import json

import pytest

from spmd_rl.plot import main as plot_main
from spmd_rl.plot import read_metrics
from spmd_rl.runtime.errors import UserError

GOOD = json.dumps({"iteration": 0, "global_step": 32, "episode_return_mean": 9.0})


@pytest.mark.parametrize("damaged", ['{"iteration": ' + "[" * 100000, "42", "[1, 2]"])
def test_a_damaged_line_is_one_user_error_naming_it(tmp_path, damaged):
    (tmp_path / "metrics.jsonl").write_text(f"{GOOD}\n{damaged}\n{GOOD}\n")
    with pytest.raises(UserError, match=r"metrics.jsonl:2 is not a JSON line"):
        read_metrics(tmp_path)


@pytest.mark.parametrize("iteration", ["null", '"3"', "3.5", "true"])
def test_a_line_whose_iteration_is_no_whole_number_is_one_user_error_naming_it(tmp_path, iteration):
    # fault pass 9, T1: {"iteration": null} beside whole numbers was a TypeError traceback from sorting, exit 1
    (tmp_path / "metrics.jsonl").write_text(f'{GOOD}\n{{"iteration": {iteration}}}\n{GOOD}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2 has iteration .*, not a whole number"):
        read_metrics(tmp_path)


@pytest.mark.parametrize("damaged", ['{"iteration": ' + "[" * 100000, "42"])
def test_a_damaged_last_line_is_skipped(tmp_path, damaged):
    (tmp_path / "metrics.jsonl").write_text(f"{GOOD}\n{damaged}\n")
    assert read_metrics(tmp_path) == [json.loads(GOOD)]


@pytest.mark.parametrize(
    "config, said",
    [
        ("run: " + "[" * 100000, "nested deeper than"),  # was a RecursionError traceback (fault pass 7, R7)
        (
            "a: &a [x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
                for p, c in zip("abcdefgh", "bcdefghi")
            ),
            "aliases",
        ),
        ("run: [unclosed", "but got"),
    ],
)
def test_a_damaged_config_is_one_user_error_naming_it(tmp_path, config, said):
    from spmd_rl.plot import read_run

    (tmp_path / "metrics.jsonl").write_text(f"{GOOD}\n")
    (tmp_path / "config.yaml").write_text(config)
    with pytest.raises(UserError, match=r"config.yaml does not load \(.*" + said):
        read_run(tmp_path)


def test_a_file_whose_only_line_is_torn_is_named_so_not_empty(tmp_path):
    # fault pass 7, R2/R5: a 30 MB metrics.jsonl whose only line is torn read "metrics.jsonl is empty"
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0, "loss": ' + "1" * 100000)
    with pytest.raises(
        UserError, match=r"metrics.jsonl holds no complete line: its only line \(100025 bytes\) is torn"
    ):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match=r"metrics.jsonl is empty"):
        read_metrics(tmp_path)


@pytest.mark.parametrize(
    ("name", "says"),
    [("no_such_dir/curves.png", "No such file or directory"), ("curves.jpgx", "Format 'jpgx' is not supported")],
)
def test_an_output_that_cannot_be_written_is_one_line(tmp_path, capsys, name, says):
    """`-o` in a directory that does not exist, or with an extension matplotlib does not draw, was a traceback and
    exit 1 (fault pass 8, P1: `python -m spmd_rl.plot RUN -o plots/curves.png` before `mkdir plots`)."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "env_steps": 32, "episode_return_mean": 9.0}) + "\n")
    output = tmp_path / name
    assert plot_main([str(run), "-o", str(output)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot write {output}") and says in err and "\n" not in err
