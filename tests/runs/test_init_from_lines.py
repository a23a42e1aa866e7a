"""run.init_from as a user sees it: one line on rank 0 confirms what was loaded (the file, how many tensors, the
prefix), and weights that do not fit are one error line for the job, from rank 0, not one per rank that builds
the policy."""

import h5py
import numpy as np
import pytest
from harness.runs import TINY, run_main


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    result = run_main("--config", TINY, f"run.dir={run_dir}", "train.total_steps=64")
    assert result.returncode == 0, result.stderr
    return run_dir


def test_a_run_started_from_weights_says_once_what_it_loaded(trained, tmp_path):
    result = run_main("--config", TINY, f"run.dir={tmp_path / 'tuned'}", f"run.init_from={trained}", nproc=2)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stdout.splitlines() if "run.init_from" in line]
    assert len(said) == 1, result.stdout
    # the whole policy: 3 layers of actor and of critic (weight and bias each) and the normalizer's 3 buffers
    assert f"loaded 15 tensors from {trained / 'policy.pt'} into the policy" in said[0], said[0]


def test_a_prefix_is_named_in_the_line(trained, tmp_path):
    result = run_main(
        "--config", TINY, f"run.dir={tmp_path / 'part'}", f"run.init_from={trained}", "run.init_prefix=actor.:actor."
    )
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stdout.splitlines() if "run.init_from" in line]
    assert len(said) == 1 and "loaded 6 tensors" in said[0] and "(prefix actor.:actor.)" in said[0], result.stdout


def test_weights_that_do_not_fit_are_one_line_for_the_job(trained, tmp_path):
    result = run_main(
        "--config", TINY, f"run.dir={tmp_path / 'bad'}", f"run.init_from={trained}", "policy.hidden_sizes=[8]", nproc=2
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("spmd_rl:")]
    assert len(lines) == 1 and "its weights do not fit" in lines[0], result.stderr
    assert lines[0].startswith("spmd_rl: rank 0"), lines[0]


def test_a_damaged_policy_file_gets_advice_for_run_init_from(trained, tmp_path):
    damaged = tmp_path / "policy.pt"
    data = bytearray((trained / "policy.pt").read_bytes())
    data[-200:-184] = bytes(b ^ 0xFF for b in data[-200:-184])  # inside the zip, before the checksum trailer
    damaged.write_bytes(bytes(data))
    result = run_main("--config", TINY, f"run.dir={tmp_path / 'from_damaged'}", f"run.init_from={damaged}")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("spmd_rl:")]
    assert len(lines) == 1 and f"{damaged} is damaged" in lines[0], result.stderr
    assert "spmd_rl.evaluate" not in lines[0], lines[0]  # that command evaluates; it starts no run from weights
    assert "<run dir>/checkpoints/latest" in lines[0], lines[0]


def test_an_hdf5_file_given_as_weights_is_named_as_such(tmp_path):
    demos = tmp_path / "demos.h5"
    with h5py.File(demos, "w") as file:  # what spmd_rl.collect and log.experience write
        file.create_dataset("data/obs", data=np.zeros((4, 4), dtype=np.float32))
    result = run_main("--config", TINY, f"run.dir={tmp_path / 'from_h5'}", f"run.init_from={demos}")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("spmd_rl:")]
    assert len(lines) == 1 and f"{demos} is an HDF5 file" in lines[0], result.stderr
    assert "pickled" not in lines[0], lines[0]
