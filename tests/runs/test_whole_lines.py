"""Ranks share one terminal or one launcher pipe: each of a rank's lines must reach it in one write, or two ranks'
error lines arrive glued ('spmd_rl: rank 1 ...spmd_rl: rank 0 ...' and then two newlines). Python's stderr writes
through at once, so a plain print() is two writes; the command line holds each line until its newline. Checked on
the writes themselves, as the file descriptor gets them (a race between two real ranks shows only sometimes)."""

import json
import subprocess
import sys

from harness.launch import ROOT, job_env, with_pythonpath

# The command line's main() with stderr as Python sets it up (a text layer writing through to an unbuffered
# file), over a file that records every write it gets.
RECORDED = """
import io, json, os, sys

class Recording(io.FileIO):
    writes = []
    def write(self, data):
        Recording.writes.append(bytes(data))
        return super().write(data)

sys.stderr = io.TextIOWrapper(Recording(os.dup(2), "w"), encoding="utf-8", write_through=True)
from spmd_rl.main import main
code = main(sys.argv[1:])
sys.stderr.flush()
print(json.dumps({"code": code, "writes": [w.decode() for w in Recording.writes]}))
"""


def test_every_line_of_a_rank_reaches_stderr_in_one_write(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", RECORDED, "algo.no_such_key=1"],
        cwd=tmp_path,
        env=with_pythonpath(job_env(), ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["code"] == 2, result.stderr
    assert report["writes"], "the error line was written"
    for write in report["writes"]:
        assert write.endswith("\n") and write.startswith("spmd_rl: "), report["writes"]
