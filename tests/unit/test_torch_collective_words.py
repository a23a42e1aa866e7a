"""A plain RuntimeError from one of torch's own collectives, where no bounded wait of ours is around it, is a
communication error whose line names the collective by where in torch it failed: it named FSDP's all-gather for
every one, also in a DDP job (fault pass 5, P1: rank 1's engine raised in its constructor while rank 0's DDP
broadcast the policy as it wrapped it; rank 0's line read "a collective inside torch (FSDP's all-gather of a sharded
policy) failed")."""

import pytest

from spmd_rl.runtime.distributed import as_comm_error

CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:8584: Connection reset by peer"


def raised_in(path: str) -> RuntimeError:
    """The gloo error as torch raises it from a function in `path` (a frame of that file, as in its traceback)."""
    code = compile(f"def collective():\n    raise RuntimeError({CLOSED!r})\n", path, "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        scope["collective"]()
    except RuntimeError as exc:
        return exc
    raise AssertionError("did not raise")


SITE = "/venv/lib/python3.11/site-packages/torch"


@pytest.mark.parametrize(
    "path, words",
    [
        (f"{SITE}/nn/parallel/distributed.py", "a collective inside torch (DDP's"),
        (f"{SITE}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "(FSDP's all-gather of a sharded policy)"),
        (f"{SITE}/distributed/distributed_c10d.py", "a collective inside torch failed"),
    ],
)
def test_the_line_names_the_collective_torch_was_in(path, words):
    comm = as_comm_error(raised_in(path), "rank 0 (colocated 0)")
    assert comm is not None
    line = str(comm)
    assert line.startswith("rank 0 (colocated 0): a collective inside torch") and words in line, line
    assert "FSDP" not in line or "fsdp" in path, line
    assert "Connection reset by peer" in line or "closed the connection" in line, line


def test_a_collective_reached_through_a_cause_is_named_too():
    try:
        raise ValueError("wrapped") from raised_in(f"{SITE}/nn/parallel/distributed.py")
    except ValueError as outer:
        comm = as_comm_error(RuntimeError(f"outer: {CLOSED}"), "rank 1 (trainer 0)")
        assert comm is not None and "FSDP" not in str(comm)
        comm = as_comm_error(outer.__cause__, "rank 1 (trainer 0)")
        assert comm is not None and "DDP's" in str(comm)
