"""Under torchrun a config error is one line from one rank, not one per rank (tests/runs/test_config_command_line.py
has the one-process command line)."""

import subprocess
from pathlib import Path

from harness.launch import command

ROOT = Path(__file__).resolve().parents[2]


def test_under_torchrun_a_config_error_is_printed_once():
    result = subprocess.run(
        [*command("torchrun", 2, standalone=True), "train.totl_steps=5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0  # torchrun reports 1 for any failed worker
    ours = [line for line in result.stderr.splitlines() if line.startswith("spmd_rl:")]
    assert len(ours) == 1, result.stderr
    assert "unknown config key 'train.totl_steps'" in ours[0]
