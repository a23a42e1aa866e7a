"""Experience storage: HDF5 files (one per writing rank), the replay buffer and the experience log."""

from spmd_rl.storage.hdf5 import ExperienceLog, HDF5Reader, HDF5Writer
from spmd_rl.storage.replay import ReplayBuffer, ShardedReplay

__all__ = ["ExperienceLog", "HDF5Reader", "HDF5Writer", "ReplayBuffer", "ShardedReplay"]
