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

# run_step COMMAND...: run a job step and exit with its status. The step runs in the background so the USR1 trap
# runs at once (bash runs traps only between commands); a wait that a trap interrupted is resumed.
run_step() {
    "$@" &
    local step_pid=$! status=0
    wait "$step_pid" || status=$?
    while kill -0 "$step_pid" 2>/dev/null; do
        status=0
        wait "$step_pid" || status=$?
    done
    echo "[$(date -Is)] job $SLURM_JOB_ID: srun exited with status $status"
    exit "$status"
}
