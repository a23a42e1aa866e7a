"""`python -m spmd_rl.collect --out PATH` where PATH is a FIFO waited in HDF5's open for a writer forever, and
`timeout`'s SIGTERM did not end it (fault pass 5, R5: killed with -9 after 700 s). A --out that is not a regular
file (a FIFO, a device, a directory) is refused with one line; the check opens nothing that waits."""

import os
import threading

import pytest

from spmd_rl.collect import _resume_point
from spmd_rl.runtime.errors import UserError


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_an_out_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    out = tmp_path / "demos.h5"
    if kind == "fifo":
        os.mkfifo(out)
    elif kind == "device":
        out.symlink_to("/dev/zero")
    else:
        out.mkdir()
    said: list[BaseException] = []

    def check() -> None:
        try:
            _resume_point(out, {})
        except BaseException as exc:  # noqa: BLE001 - what the main thread asserts on
            said.append(exc)

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"--out {kind}: still waiting after 30 s"
    assert len(said) == 1 and isinstance(said[0], UserError), said
    assert str(said[0]).startswith(f"{out} is not a regular file") and "give --out a file" in str(said[0]), said
