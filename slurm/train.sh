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
#   MASTER_PORT     rendezvous port (default 20000 + job id % 12000, below the ephemeral ports)
#   PYTHON          interpreter with spmd_rl installed (default python on PATH)
#   SPMD_RL_HOME    the repository root, where slurm/common.sh is (default: the directory sbatch ran in)
# Logs: this script's output goes to --output (Slurm opens it before the script runs, so it cannot be in the run
# directory; a link to it is put there), each rank's output to RUN_DIR/logs/ as well.
# Preemption and time limits: on SIGUSR1 (120 s before the time limit) or a preemption's SIGTERM, the ranks save
# a checkpoint and stop; the job then requeues itself and, with the same job id and RUN_DIR, resumes from that
# checkpoint until the run is finished (slurm/common.sh, PREEMPTION HOOK). To continue a run by hand, submit the
# same command with RUN_DIR (or run.dir=) set to its directory.
#
#SBATCH --job-name=spmd_rl
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; the agent starts the ranks
#SBATCH --cpus-per-task=8            # CPUs for all ranks of one node
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out     # relative to the directory sbatch ran in
#SBATCH --open-mode=append           # a requeued job appends to its log instead of truncating it
#SBATCH --signal=B:USR1@120          # SIGUSR1 to this script (B: the batch shell only) 120 s before the time limit
#SBATCH --requeue                    # a preempted or warned job may requeue itself (slurm/common.sh)
##SBATCH --gpus-per-node=8           # GPU nodes: uncomment (RANKS_PER_NODE then defaults to the GPU count)
set -euo pipefail
source "${SPMD_RL_HOME:-$SLURM_SUBMIT_DIR}/slurm/common.sh" || {
    echo "slurm/common.sh not found: submit from the repository root or set SPMD_RL_HOME" >&2; exit 2; }
parse_run_args "sbatch slurm/train.sh" "$@"
RANKS_PER_NODE=${RANKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-2}}
head_addr=${MASTER_ADDR:-$(head_node_address)}
rdzv_port=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 12000))}
prepare_run_dir

echo "[$(date -Is)] job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES node(s) x $RANKS_PER_NODE ranks, rendezvous" \
     "$head_addr:$rdzv_port, run dir $RUN_DIR"
# --kill-on-bad-exit: when one node's agent fails, the others are stopped instead of waiting for their timeout.
# --cpus-per-task is passed on explicitly: srun 22.05 no longer reads it from the batch job, and a task with one
# CPU would confine all ranks of a node to it where Slurm binds tasks to CPUs.
# --mpi=none: no PMI variables for the agents, whatever the cluster's MpiDefault (they would read as an MPI launch).
# Signals: Slurm signals every process of the step, so the ranks hear SIGUSR1/SIGTERM from Slurm directly. The agent
# must stay out of it: SIGUSR1 would kill it (and Slurm then the ranks, mid-checkpoint), and on SIGTERM it would
# send the ranks a second SIGTERM (a stop without a checkpoint) and SIGKILL them 30 s later. So the agent ignores
# both (trap '' in the shell that execs it; --signals-to-handle leaves SIGTERM out) and waits for the ranks to
# stop, which install their own handlers.
run_step srun --kill-on-bad-exit=1 --mpi=none --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
    --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    bash -c 'trap "" USR1 TERM; exec "$@"' torchrun \
    "${PYTHON:-python}" -m torch.distributed.run --signals-to-handle=SIGINT,SIGHUP,SIGQUIT \
        --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$RANKS_PER_NODE" \
        --rdzv_backend=c10d --rdzv_endpoint="$head_addr:$rdzv_port" --rdzv_id="$SLURM_JOB_ID" \
        --log-dir="$RUN_DIR/logs/torchrun" --tee=3 \
        -m spmd_rl.main --config "$CONFIG" run.dir="$RUN_DIR" "${OVERRIDES[@]}"
