#!/usr/bin/env bash
# One process, no launcher: the laptop path. Every argument goes to spmd_rl.main unchanged.
#
#   launch/local.sh --config configs/ppo_cartpole.yaml train.total_steps=50000
#
# PYTHON picks the interpreter (default: python on PATH, e.g. the activated venv).
set -euo pipefail
exec "${PYTHON:-python}" -m spmd_rl.main "$@"
