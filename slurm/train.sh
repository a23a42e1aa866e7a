#!/usr/bin/env bash
# Train under Slurm, one or many nodes: srun starts ONE torchrun agent per node, each agent starts
# RANKS_PER_NODE ranks, and the agents meet in a c10d rendezvous on the first node.
#
#   sbatch slurm/train.sh configs/ppo_cartpole.yaml [section.key=value ...]
#   sbatch --nodes=4 slurm/train.sh configs/ppo_halfcheetah.yaml train.total_steps=10000000
#   RANKS_PER_NODE=8 sbatch --nodes=2 --cpus-per-task=16 slurm/train.sh configs/...   (sbatch passes the
#                                                                                    environment on)
# Environment (all optional):
#   RANKS_PER_NODE  ranks per node (default: the node's GPUs if Slurm allotted any, else 2)
#   RUN_DIR         run directory (default runs/<job name>-<job id>; a run.dir=... override wins). A requeued job
#                   keeps its job id, so it finds the same directory.
#   MASTER_ADDR     rendezvous address (default: the address Slurm knows for the first node)
#   MASTER_PORT     rendezvous port (default 20000 + job id % 20000)
#   PYTHON          interpreter with spmd_rl installed (default python on PATH)
# Logs: this script's output goes to --output (Slurm opens it before the script runs, so it cannot be in the run
# directory; a link to it is put there), each rank's output to RUN_DIR/logs/ as well.
#
#SBATCH --job-name=spmd_rl
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; the agent starts the ranks
#SBATCH --cpus-per-task=8            # CPUs for all ranks of one node
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out     # relative to the directory sbatch ran in
#SBATCH --open-mode=append           # a requeued job appends to its log instead of truncating it
#SBATCH --signal=B:USR1@120          # SIGUSR1 to this script (B: the batch shell only) 120 s before the time limit
#SBATCH --requeue                    # preempted or failed nodes: Slurm puts the job back in the queue
##SBATCH --gpus-per-node=8           # GPU nodes: uncomment (RANKS_PER_NODE then defaults to the GPU count)
set -euo pipefail

if (( $# < 1 )); then
    echo "usage: sbatch slurm/train.sh CONFIG [section.key=value ...]" >&2
    exit 2
fi
config=$1
shift
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
for arg in "$@"; do
    [[ $arg == run.dir=* ]] && RUN_DIR=${arg#run.dir=}
done
RANKS_PER_NODE=${RANKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-2}}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The node's address as Slurm knows it: works where node names do not resolve (and on emulated nodes).
head_addr=${MASTER_ADDR:-$(scontrol show node "$head_node" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')}
rdzv_port=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

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

echo "[$(date -Is)] job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES node(s) x $RANKS_PER_NODE ranks, rendezvous" \
     "$head_addr:$rdzv_port, run dir $RUN_DIR"
# --kill-on-bad-exit: when one node's agent fails, the others are stopped instead of waiting for their timeout.
# srun runs in the background so the USR1 trap runs at once (bash runs traps only between commands).
# --cpus-per-task is passed on explicitly: srun 22.05 no longer reads it from the batch job, and a task with one
# CPU would confine all ranks of a node to it where Slurm binds tasks to CPUs.
# --mpi=none: no PMI variables for the agents, whatever the cluster's MpiDefault (they would read as an MPI launch).
srun --kill-on-bad-exit=1 --mpi=none --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
    --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    "${PYTHON:-python}" -m torch.distributed.run \
        --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$RANKS_PER_NODE" \
        --rdzv_backend=c10d --rdzv_endpoint="$head_addr:$rdzv_port" --rdzv_id="$SLURM_JOB_ID" \
        --log-dir="$RUN_DIR/logs/torchrun" --tee=3 \
        -m spmd_rl.main --config "$config" run.dir="$RUN_DIR" "$@" &
srun_pid=$!
status=0
wait "$srun_pid" || status=$?
while kill -0 "$srun_pid" 2>/dev/null; do  # a trap interrupted the wait; srun still runs
    status=0
    wait "$srun_pid" || status=$?
done
echo "[$(date -Is)] job $SLURM_JOB_ID: srun exited with status $status"
exit "$status"
