#!/usr/bin/env bash
# Train under Slurm with one srun task per rank, no torchrun: every task finds its rank in SLURM_PROCID and
# joins the process group at the first node of the step (spmd_rl.launch, "slurm" launch source).
#
#   sbatch slurm/train_srun.sh configs/ppo_cartpole.yaml [section.key=value ...]
#   sbatch --nodes=2 --ntasks-per-node=8 slurm/train_srun.sh configs/ppo_halfcheetah.yaml
#
# Environment (all optional):
#   RUN_DIR      run directory (default runs/<job name>-<job id>; a run.dir=... override wins)
#   MASTER_ADDR  address of the first node (default: the address Slurm knows for it)
#   MASTER_PORT  port (default 20000 + job id % 20000, derived by every task on its own)
#   PYTHON       interpreter with spmd_rl installed (default python on PATH)
# Logs: this script's output, every line of the ranks prefixed with its rank, goes to --output; a link to it is
# put into RUN_DIR/logs/.
#
#SBATCH --job-name=spmd_rl
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4          # ranks per node
#SBATCH --cpus-per-task=2            # CPUs per rank
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out     # relative to the directory sbatch ran in
#SBATCH --open-mode=append           # a requeued job appends to its log instead of truncating it
#SBATCH --signal=B:USR1@120          # SIGUSR1 to this script (B: the batch shell only) 120 s before the time limit
#SBATCH --requeue                    # preempted or failed nodes: Slurm puts the job back in the queue
##SBATCH --gpus-per-task=1           # GPU nodes: uncomment, one GPU per rank
set -euo pipefail

if (( $# < 1 )); then
    echo "usage: sbatch slurm/train_srun.sh CONFIG [section.key=value ...]" >&2
    exit 2
fi
config=$1
shift
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
for arg in "$@"; do
    [[ $arg == run.dir=* ]] && RUN_DIR=${arg#run.dir=}
done
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The node's address as Slurm knows it: works where node names do not resolve (and on emulated nodes).
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show node "$head_node" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')}
export MASTER_ADDR
# srun does not limit threads as torchrun does: one rank would otherwise start a thread per core of the node.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

mkdir -p "$RUN_DIR/logs"
batch_log=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *StdOut=//p')
[[ -n $batch_log ]] && ln -sfn "$batch_log" "$RUN_DIR/logs/slurm-$SLURM_JOB_ID.out"

# ---- PREEMPTION HOOK ----------------------------------------------------------------------------------------
# Slurm sends SIGUSR1 120 s before the time limit (and on preemption with a grace time). Today this only logs:
# spmd_rl cannot resume yet, so a requeued job starts over. Once checkpoint resume exists, this will tell the
# ranks to write $RUN_DIR/checkpoints/latest (forward the signal: scancel --signal=USR1 "$SLURM_JOB_ID.0"),
# wait for it, and `scontrol requeue "$SLURM_JOB_ID"`; the requeued job (same id, same RUN_DIR) resumes from
# $RUN_DIR/checkpoints/latest.
# shellcheck disable=SC2317  # reached through the trap
on_usr1() {
    echo "[$(date -Is)] job $SLURM_JOB_ID: SIGUSR1 (time limit or preemption ahead). Checkpoint resume does not" \
         "exist yet: nothing is saved, the run ends when Slurm stops it." >&2
}
trap on_usr1 USR1
# --------------------------------------------------------------------------------------------------------------

echo "[$(date -Is)] job $SLURM_JOB_ID: $SLURM_NTASKS ranks on $SLURM_JOB_NUM_NODES node(s), master $MASTER_ADDR," \
     "run dir $RUN_DIR"
# --kill-on-bad-exit: when one rank fails, the others are stopped instead of waiting for their timeout.
# srun runs in the background so the USR1 trap runs at once (bash runs traps only between commands).
# --cpus-per-task is passed on explicitly: srun 22.05 no longer reads it from the batch job.
# --mpi=none: with a cluster's MpiDefault=pmix the tasks would see PMIX_RANK and be read as an MPI launch.
srun --kill-on-bad-exit=1 --mpi=none --label --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    "${PYTHON:-python}" -m spmd_rl.main --config "$config" run.dir="$RUN_DIR" "$@" &
srun_pid=$!
status=0
wait "$srun_pid" || status=$?
while kill -0 "$srun_pid" 2>/dev/null; do  # a trap interrupted the wait; srun still runs
    status=0
    wait "$srun_pid" || status=$?
done
echo "[$(date -Is)] job $SLURM_JOB_ID: srun exited with status $status"
exit "$status"
