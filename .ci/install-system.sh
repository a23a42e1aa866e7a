#!/usr/bin/env bash
# System packages the launcher tests need: Open MPI (mpirun + headers for mpi4py) and a Slurm that the tests
# bring up themselves (slurmctld + slurmd on this host; see tests/harness/slurm_cluster.py). Run as root, before the venv.
# The Slurm tests use AuthType=auth/none, so munge is installed only because Debian's slurm packages expect it;
# no munge daemon is started. MetaWorld's camera images render headless through EGL (libegl1, libegl-mesa0), else
# OSMesa (libosmesa6).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends \
    openmpi-bin libopenmpi-dev \
    slurmctld slurmd slurm-client munge \
    libegl1 libegl-mesa0 libosmesa6
