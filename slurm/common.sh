# Shared by slurm/train.sh and slurm/train_srun.sh (sourced, not run). sbatch runs a copy of the batch script
# from its spool directory, so the scripts find this file through the directory sbatch was run in (or
# SPMD_RL_HOME, the repository root).

# parse_run_args USAGE CONFIG [overrides...]: sets CONFIG, OVERRIDES and RUN_DIR (a run.dir=... override wins;
# else RUN_DIR from the environment; else runs/<job name>-<job id>: a requeued job keeps its id, so its directory).
parse_run_args() {
    local usage=$1
    shift
    if (( $# < 1 )); then
        echo "usage: $usage CONFIG [section.key=value ...]" >&2
        exit 2
    fi
    CONFIG=$1
    shift
    OVERRIDES=()
    RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
    local arg
    for arg in "$@"; do  # run.dir= is passed once, as RUN_DIR (a key given twice is an error)
        if [[ $arg == run.dir=* ]]; then RUN_DIR=${arg#run.dir=}; else OVERRIDES+=("$arg"); fi
    done
    return 0
}

# The first node's address as Slurm knows it: works where node names do not resolve (and on emulated nodes).
head_node_address() {
    local head_node
    head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    scontrol show node "$head_node" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p'
}

# The run directory with a link to this job's batch log (Slurm opens --output before the script runs, so the log
# itself cannot live there).
prepare_run_dir() {
    mkdir -p "$RUN_DIR/logs"
    local batch_log
    batch_log=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *StdOut=//p')
    [[ -n $batch_log ]] && ln -sfn "$batch_log" "$RUN_DIR/logs/slurm-$SLURM_JOB_ID.out"
    return 0
}

# ---- PREEMPTION HOOK ----------------------------------------------------------------------------------------
# What reaches the ranks (measured with Slurm 22.05):
# - The time limit: --signal=B:USR1@120 sends SIGUSR1 to this script only, 120 s ahead. on_usr1 passes it on with
#   `scancel --signal=USR1 JOB`, which Slurm delivers to every process of the job's steps (the srun task and its
#   children alike), so every rank gets one SIGUSR1.
# - A preemption (measured: PreemptMode=REQUEUE with a GraceTime, with and without SchedulerParameters=
#   preempt_send_user_signal) sends SIGTERM to every process of the job's steps, not to this script, and sets the
#   job's PreemptTime. A job that ends within its grace time is not requeued by Slurm: this hook does it.
# On either signal the ranks finish the iteration, agree, save a checkpoint in $RUN_DIR/checkpoints/ and exit 75.
# Once the step has ended, a preempted run that did not finish (no finished.json) requeues this job: it goes back
# in the queue with the same job id, so the same RUN_DIR, where the ranks resume from the latest checkpoint
# (run.resume=auto; Slurm holds a requeued job for 2 minutes before it may start again). The stop must fit in the
# warning: raise @120 in --signal (or ask for a longer GraceTime) when an iteration plus a checkpoint take longer.
# A job cancelled with scancel is not requeued; srun answers the SIGTERM that scancel sends this script with
# SIGKILL to the ranks, so only the last periodic checkpoint survives a cancel.
USR1_AT=""
# shellcheck disable=SC2317  # reached through the trap
on_usr1() {
    USR1_AT=$(date -Is)
    echo "[$USR1_AT] job $SLURM_JOB_ID: SIGUSR1 (time limit or preemption ahead): the ranks save a checkpoint" \
         "and stop, then the job requeues itself" >&2
    scancel --signal=USR1 "$SLURM_JOB_ID" || echo "job $SLURM_JOB_ID: scancel --signal=USR1 failed" >&2
}
trap on_usr1 USR1

# requeue_if_preempted: after the step ended, put a preempted run that did not finish back in the queue. The
# requeued job resumes from the newest checkpoint there is (the one the ranks saved on the signal, or an earlier
# one if they had no time for it).
requeue_if_preempted() {
    if [[ -e $RUN_DIR/finished.json ]]; then
        return 0
    fi
    local preempted=$USR1_AT
    if [[ -z $preempted ]]; then
        preempted=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/.*PreemptTime=\([^ ]*\).*/\1/p')
    fi
    if [[ -z $preempted || $preempted == None ]]; then
        return 0
    fi
    local latest
    latest=$(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null || echo "none")
    echo "[$(date -Is)] job $SLURM_JOB_ID: preempted ($preempted); requeued to resume from checkpoint $latest"
    scontrol requeue "$SLURM_JOB_ID" ||
        echo "job $SLURM_JOB_ID: scontrol requeue failed; resubmit with RUN_DIR=$RUN_DIR to resume" >&2
}
# --------------------------------------------------------------------------------------------------------------

# run_step COMMAND...: run a job step, requeue the job if it was preempted, and exit with the step's status. The
# step runs in the background so the traps run at once (bash runs traps only between commands); a wait that a
# trap interrupted is resumed.
run_step() {
    "$@" &
    local step_pid=$! status=0
    wait "$step_pid" || status=$?
    while kill -0 "$step_pid" 2>/dev/null; do
        status=0
        wait "$step_pid" || status=$?
    done
    echo "[$(date -Is)] job $SLURM_JOB_ID: srun exited with status $status"
    requeue_if_preempted
    exit "$status"
}
