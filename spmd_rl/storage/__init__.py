"""Experience storage: HDF5 files (one per writing rank), the replay buffer and the experience log."""

from spmd_rl.storage.experience_log import ExperienceLog
from spmd_rl.storage.reader import HDF5Reader
from spmd_rl.storage.replay import ReplayBuffer, ShardedReplay
from spmd_rl.storage.writer import HDF5Writer

__all__ = ["ExperienceLog", "HDF5Reader", "HDF5Writer", "ReplayBuffer", "ShardedReplay"]
