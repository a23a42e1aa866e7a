"""The GPU path's choices, checked on CPU: checkpoints load to the CPU whatever the rank's device, env ranks stay on
the CPU, every GPU-using rank of a node gets a GPU of its own (or the run stops before start, naming the fix), and
every rank picks the same backend."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.config.sections import LayoutSection
from spmd_rl.persist.checkpoint import CheckpointStore, capture_rng_state
from spmd_rl.persist.rank_state import load_state
from spmd_rl.run.topology import build_topology
from spmd_rl.runtime.distributed import choose_backend, choose_device
from spmd_rl.runtime.errors import UserError


def test_a_checkpoint_loads_to_the_cpu_on_a_rank_whose_device_is_not_the_cpu(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save({"trainer": {"policy": {"w": torch.ones(3)}}, "rng": capture_rng_state()}, iteration=4, rank=0)
    checkpoint = store.commit(4, world_size=1)
    with torch.device("meta"):  # what a rank on another device has as its default: the load names the CPU itself
        state = load_state(checkpoint, 0)
    policy = state["trainer"]["policy"]
    assert policy["w"].device.type == "cpu" and policy["w"].tolist() == [1.0, 1.0, 1.0]
    torch.set_rng_state(state["rng"]["torch"])  # what restore_rng_state needs: a CPU ByteTensor


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def _split(trainer: int, inference: int, env: int):
    return build_topology(
        LayoutSection(mode="split", trainer=trainer, inference=inference, env=env), trainer + inference + env
    )


def test_env_ranks_stay_on_the_cpu_and_each_gpu_rank_gets_its_own_gpu(two_gpus):
    topology = _split(1, 1, 2)  # one node of 4 ranks: trainer 0, inference 1, env 2 and 3
    slots = [topology.gpu_slot(rank, local_rank=rank, local_world_size=4) for rank in range(4)]
    assert slots == [(0, 2), (1, 2), (None, 2), (None, 2)]
    assert [str(choose_device("auto", *slot)) for slot in slots] == ["cuda:0", "cuda:1", "cpu", "cpu"]
    assert [str(choose_device("cpu", *slot)) for slot in slots] == ["cpu"] * 4


def test_a_node_of_env_ranks_needs_no_gpu(two_gpus):
    topology = _split(1, 1, 6)  # two nodes of 4: trainer and inference on the first, only env ranks on the second
    assert [topology.gpu_slot(rank, rank % 4, 4) for rank in range(8)] == [
        (0, 2),
        (1, 2),
        (None, 2),
        (None, 2),
        (None, 0),
        (None, 0),
        (None, 0),
        (None, 0),
    ]


def test_more_gpu_ranks_on_a_node_than_gpus_is_a_user_error_naming_the_fix(two_gpus):
    colocated = build_topology(LayoutSection(), 4)  # every colocated rank acts and learns
    slot = colocated.gpu_slot(3, local_rank=3, local_world_size=4)
    assert slot == (3, 4)
    with pytest.raises(
        UserError,
        match=r"4 ranks on this node compute on a GPU .* it has 2 GPU\(s\): run fewer "
        r"ranks per node, .* or set train.device=cpu",
    ):
        choose_device("auto", *slot)
    assert str(choose_device("cpu", *slot)) == "cpu"


def test_every_rank_picks_the_same_backend(two_gpus):
    assert choose_backend("auto") == choose_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert choose_backend("cpu") == "gloo"


def test_cuda_asked_for_without_cuda_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert str(choose_device("auto", 0)) == "cpu" and choose_backend("auto") == "gloo"
    with pytest.raises(UserError, match="train.device=cuda but CUDA is not available"):
        choose_device("cuda", 0)


def test_with_nccl_the_groups_time_out_after_every_bounded_wait():
    from datetime import timedelta

    from spmd_rl.runtime.distributed import NCCL_WATCHDOG_MARGIN, Runtime

    bound = timedelta(seconds=30)
    assert Runtime(None, torch.device("cpu"), "gloo", bound).group_timeout == bound
    nccl = Runtime(None, torch.device("cpu"), "cpu:gloo,cuda:nccl", bound)
    assert nccl.group_timeout == bound + NCCL_WATCHDOG_MARGIN > bound


def test_train_deterministic_turns_on_deterministic_algorithms(monkeypatch):
    from spmd_rl.config import load_config
    from spmd_rl.run.driver import configure_torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    try:
        configure_torch(load_config(None, ["train.deterministic=true"]))
        assert torch.are_deterministic_algorithms_enabled()
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.set_num_threads(before[1])
