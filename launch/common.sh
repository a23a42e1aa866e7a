# Sourced by launch/mpirun.sh and launch/torchrun.sh: how a launcher script passes signals on and ends with the
# ranks' exit code. (mpirun and torchrun exit 1 when signalled, whatever their ranks did.)
#
#   make_exit_file                            # sets exit_file: rank 0 writes its own exit code there
#                                             # (SPMD_RL_EXIT_FILE=$exit_file), and failure_dir: failing ranks
#                                             # leave their records there (SPMD_RL_FAILURE_DIR, ranks on this host)
#   launcher ... & wait_for_launcher $! [FILTER_PID]   # and exits as described below (after the launcher's
#                                             # output filter, if it has one, printed its last line)

make_exit_file() {   # not in $(...): the trap that removes the files must belong to the script's own shell
    exit_file=$(mktemp "${TMPDIR:-/tmp}/spmd_rl-exit.XXXXXX")
    failure_dir=$(mktemp -d "${TMPDIR:-/tmp}/spmd_rl-failures.XXXXXX")
    trap 'rm -f "$exit_file"; rm -rf "$failure_dir"' EXIT
}

# Passes SIGINT, SIGTERM and SIGUSR1 on to the launcher (which passes them on to every rank), waits until it has
# exited, and exits: 75 when it failed only because the ranks stopped cleanly with a checkpoint, else its status.
wait_for_launcher() {
    local job=$1 filter=${2:-} sig status ranks_code
    for sig in INT TERM USR1; do
        # shellcheck disable=SC2064  # the job's pid is fixed now
        trap "kill -$sig $job 2>/dev/null" "$sig"
    done
    while true; do   # a trapped signal ends `wait` early: wait again until the launcher itself has exited
        wait "$job" && status=0 || status=$?
        kill -0 "$job" 2>/dev/null || break
    done
    if [[ -n $filter ]]; then   # (a bare `wait` does not wait for a process substitution)
        wait "$filter" 2>/dev/null || true
    fi
    # The launcher may have killed rank 0 before it printed the job summary (mpirun kills every rank as soon as
    # one dies): the summary from the records the failing ranks left, unless rank 0 spoke (spmd_rl/runtime/postmortem.py).
    # Under torchrun the records are per attempt (attempt0, attempt1, ... with MAX_RESTARTS): the last one's.
    local records=$failure_dir attempt
    for attempt in $(cd "$failure_dir" && compgen -G "attempt*" | sort -V); do
        records=$failure_dir/$attempt
    done
    if [[ $status != 0 ]] && compgen -G "$records/rank*.json" >/dev/null; then
        "${PYTHON:-python}" -m spmd_rl.runtime.postmortem "$records" || true
    fi
    ranks_code=$(cat "$exit_file" 2>/dev/null || true)
    if [[ $status != 0 && $ranks_code == 75 ]]; then
        exit 75
    fi
    exit "$status"
}
