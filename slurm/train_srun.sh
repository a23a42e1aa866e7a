#!/usr/bin/env bash
# Train under Slurm with one srun task per rank, no torchrun: every task finds its rank in SLURM_PROCID and
# joins the process group at the first node of the step (spmd_rl.runtime.launch, "slurm" launch source).
#
#   sbatch slurm/train_srun.sh configs/ppo_cartpole.yaml [section.key=value ...]
#   sbatch --nodes=2 --ntasks-per-node=8 slurm/train_srun.sh configs/ppo_halfcheetah.yaml
#
# Environment (all optional):
#   RUN_DIR      run directory (default runs/<job name>-<job id>; a run.dir=... override wins). A requeued job
#                keeps its job id, so it finds the same directory.
#   MASTER_ADDR  address of the first node (default: the address Slurm knows for it)
#   MASTER_PORT  port (default 20000 + job id % 12000, derived by every task on its own)
#   PYTHON       interpreter with spmd_rl installed (default python on PATH)
#   SPMD_RL_HOME the repository root, where slurm/common.sh is (default: the directory sbatch ran in)
# Logs: this script's output, every line of the ranks prefixed with its rank, goes to --output; a link to it is
# put into RUN_DIR/logs/.
# Preemption and time limits: on SIGUSR1 (120 s before the time limit) or a preemption's SIGTERM, the ranks save
# a checkpoint and stop; the job then requeues itself and, with the same job id and RUN_DIR, resumes from that
# checkpoint until the run is finished (slurm/common.sh, PREEMPTION HOOK). To continue a run by hand, submit the
# same command with RUN_DIR (or run.dir=) set to its directory.
#
#SBATCH --job-name=spmd_rl
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4          # ranks per node
#SBATCH --cpus-per-task=2            # CPUs per rank
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out     # relative to the directory sbatch ran in
#SBATCH --open-mode=append           # a requeued job appends to its log instead of truncating it
#SBATCH --signal=B:USR1@120          # SIGUSR1 to this script (B: the batch shell only) 120 s before the time limit
#SBATCH --requeue                    # a preempted or warned job may requeue itself (slurm/common.sh)
##SBATCH --gpus-per-task=1           # GPU nodes: uncomment, one GPU per rank
set -euo pipefail
source "${SPMD_RL_HOME:-$SLURM_SUBMIT_DIR}/slurm/common.sh" || {
    echo "slurm/common.sh not found: submit from the repository root or set SPMD_RL_HOME" >&2; exit 2; }
parse_run_args "sbatch slurm/train_srun.sh" "$@"
MASTER_ADDR=${MASTER_ADDR:-$(head_node_address)}
export MASTER_ADDR
# srun does not limit threads as torchrun does: one rank would otherwise start a thread per core of the node.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
prepare_run_dir

echo "[$(date -Is)] job $SLURM_JOB_ID: $SLURM_NTASKS ranks on $SLURM_JOB_NUM_NODES node(s), master $MASTER_ADDR," \
     "run dir $RUN_DIR"
# --kill-on-bad-exit: when one rank fails, the others are stopped instead of waiting for their timeout.
# --cpus-per-task is passed on explicitly: srun 22.05 no longer reads it from the batch job.
# --mpi=none: with a cluster's MpiDefault=pmix the tasks would see PMIX_RANK and be read as an MPI launch.
run_step srun --kill-on-bad-exit=1 --mpi=none --label --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    "${PYTHON:-python}" -m spmd_rl.main --config "$CONFIG" run.dir="$RUN_DIR" "${OVERRIDES[@]}"
