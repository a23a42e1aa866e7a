"""Resuming a run whose metrics.jsonl or TensorBoard event file was damaged (a torn write, bytes from a disk error):
every sound record is kept, one `spmd_rl: note:` line names what was dropped, and the run goes on."""

import json
import os

import pytest
from harness.runs import TINY, run_main

from spmd_rl.persist.event_files import sound_records
from spmd_rl.run.metrics import drop_records_after
from spmd_rl.runtime.errors import UserError


@pytest.mark.slow
def test_a_resume_drops_damaged_lines_and_event_records_with_one_note_and_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    common = ("--config", TINY, f"run.dir={run_dir}", "log.tensorboard=true")
    assert run_main(*common, "run.stop_after_iterations=3").returncode == 75
    metrics = run_dir / "metrics.jsonl"
    sound = metrics.read_bytes().splitlines()  # iterations 0, 1, 2
    # non-UTF-8 bytes and deeply nested brackets (json.loads: a RecursionError) between two records, and a torn
    # record at the end
    nested = b"[" * 100_000 + b"]" * 100_000
    metrics.write_bytes(
        b"\n".join([sound[0], b"\xff\xfe\x00 disk error", nested, *sound[1:], b'{"iteration": 3, "env_'])
    )
    (event_file,) = (run_dir / "tensorboard").iterdir()
    records, _, _ = sound_records(event_file.read_bytes())
    flipped = bytearray(b"".join(records))
    bad = len(records) - 1  # the last iteration's record (one event holds an iteration's scalars)
    flipped[sum(map(len, records[:bad])) + 14] ^= 0xFF  # a byte of its data: its checksum fails
    event_file.write_bytes(bytes(flipped) + records[bad][:20])  # and a torn record after the last

    resumed = run_main(*common)

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    notes = [line for line in resumed.stdout.splitlines() if line.startswith("spmd_rl: note:")]
    assert notes == [
        f"spmd_rl: note: {metrics}: dropped 3 damaged line(s) (line 2, 3, 6: not a whole JSON record); kept the rest; "
        f"{event_file}: dropped 1 record(s) failing their checksum and 20 unreadable byte(s) at the end, kept "
        f"{len(records) - 1} record(s)"
    ]
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == list(range(8))
    assert metrics.read_bytes().splitlines()[:3] == sound
    assert sound_records(event_file.read_bytes()) == (records[:bad] + records[bad + 1 :], 0, 0)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_metrics_file_that_is_not_a_regular_file_is_one_line_not_a_hang(tmp_path, kind):
    metrics = tmp_path / "metrics.jsonl"
    os.mkfifo(metrics) if kind == "fifo" else metrics.symlink_to("/dev/zero")
    with pytest.raises(UserError, match=r"metrics\.jsonl is not a regular file \(a (FIFO|character device)\)"):
        drop_records_after(metrics, 3)
