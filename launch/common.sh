# Sourced by launch/mpirun.sh and launch/torchrun.sh: how a launcher script passes signals on and ends with the
# ranks' exit code. (mpirun and torchrun exit 1 when signalled, whatever their ranks did.)
#
#   make_exit_file                            # sets exit_file: rank 0 writes its own exit code there
#                                             # (SPMD_RL_EXIT_FILE=$exit_file), and failure_dir: failing ranks
#                                             # leave their records there (SPMD_RL_FAILURE_DIR, ranks on this host)
#   launcher ... & wait_for_launcher $! [FILTER_PID]   # and exits as described below (after the launcher's
#                                             # output filter, if it has one, printed its last line)

# The launch scripts filter the ranks' stderr through awk, line by line. mawk (Debian's awk) reads a pipe until its
# buffer is full or the pipe closes before it runs the program on the first line, so a rank's line waited for 4 KiB
# more output or for the job's end (a failed attempt's line under MAX_RESTARTS came after the next attempt's `done:`,
# fault pass 4, D8); `-W interactive` makes it read a line at a time. gawk and busybox awk read lines as they come.
line_awk=(awk)
if awk -W version 2>/dev/null | grep -q '^mawk'; then
    line_awk=(awk -W interactive)
fi

make_exit_file() {   # not in $(...): the trap that removes the files must belong to the script's own shell
    exit_file=$(mktemp "${TMPDIR:-/tmp}/spmd_rl-exit.XXXXXX")
    signal_file=$(mktemp "${TMPDIR:-/tmp}/spmd_rl-signal.XXXXXX")   # the signal this script passed on, if any
    reported_file=$(mktemp "${TMPDIR:-/tmp}/spmd_rl-reported.XXXXXX")   # non-empty: the launcher reported a rank's end
    failure_dir=$(mktemp -d "${TMPDIR:-/tmp}/spmd_rl-failures.XXXXXX")
    trap 'rm -f "$exit_file" "$signal_file" "$reported_file"; rm -rf "$failure_dir"' EXIT
}

# The output filters' test (an awk function; awk -v exit_file=... -v signal_file=...) of whether rank 0 has spoken
# for the job: it left its exit code in $exit_file (its line, the stop line or the job summary). A signal's code
# (128+N) counts only when this script passed a signal on, someone's request to stop: otherwise the launcher
# stopped rank 0 after another rank ended, and the launcher's report is the only account of that rank (rank 0 said
# "stopped by SIGTERM while starting", as if someone had asked: fault pass 5, J6). A rank that left its failure record
# in $failure_dir (awk -v records=...) has spoken too: it printed its own line first (a plug-in's import hanging on
# rank 1 before the group formed, fault pass 6, U3b), and the script prints the summary from the records.
# shellcheck disable=SC2016  # awk's program, not the shell's
spoke_awk='function spoke(  code, sig) { code = ""; getline code < exit_file; close(exit_file)
        if (code != "" && code !~ /^(129|1[3-9][0-9]|2[0-5][0-9])$/) return 1
        sig = ""; if (code != "") { getline sig < signal_file; close(signal_file) }; if (sig != "") return 1
        return records != "" && system("find \"" records "\" -name \"rank*.json\" -print -quit | grep -q .") == 0 }'

# Passes SIGINT, SIGTERM and SIGUSR1 (and SIGHUP, as SIGTERM) on to the launcher (which passes them on to every rank),
# waits until it has exited, and exits with the job's code: when the launcher failed, the first failing rank's 2, 3 or
# 4 from the failure records, else rank 0's own (the launcher's is 1 whatever the ranks did) where it is 2 (a config
# or layout error, the same on every rank), 3, 4 or 75 (a checkpointed stop), and, after a signal to this script,
# 128+N (rank 0's, or N's itself with a line of its own when rank 0 left no code: the signal came before it could);
# else the launcher's status. A script started with SIGINT ignored (a background job, `cmd &`, of a non-interactive
# shell) cannot trap it, as bash says, so it ignores a SIGINT; SIGTERM and SIGUSR1 still stop the job with a
# checkpoint.
# Passes signal $1 on to pid $2, unless it passed the same one on less than 2 s ago: that is the same request
# arriving again (`timeout` sends its SIGTERM to this script and then to its whole process group; a group signal
# reaches this script directly and through `timeout`), as the ranks take it (REPEAT_WINDOW_S in
# spmd_rl/runtime/signals.py). A torchrun agent given a second SIGTERM while it logs the first printed a 20-line
# "--- Logging error ---" block (fault pass 5, K0, J2). A second signal after the window is passed on: it stops the
# ranks at once.
relayed_signal="" relayed_at=0
relay_signal() {
    local now=${EPOCHREALTIME:-$SECONDS.000000}
    now=$((10#${now//[.,]/}))   # microseconds (the separator follows the locale)
    if [[ $1 == "$relayed_signal" ]] && ((now - relayed_at < 2000000)); then
        return 0
    fi
    relayed_signal=$1 relayed_at=$now
    kill -"$1" "$2" 2>/dev/null
}

wait_for_launcher() {
    local job=$1 filter=${2:-} sig status ranks_code
    signalled=""
    if [[ $(trap -p INT) == "trap -- '' SIGINT" ]]; then   # ignored on entry: bash cannot trap it (see above)
        echo "spmd_rl: $(basename "$0"): note: started with SIGINT ignored (a background job of a script, \`cmd &\`):" \
            "Ctrl-C will not reach this job; stop it with SIGTERM (kill -TERM $$), which saves a checkpoint"
    fi
    for sig in INT TERM USR1; do
        # shellcheck disable=SC2064  # the job's pid is fixed now
        trap "signalled=\${signalled:-$sig}; echo $sig > \"$signal_file\"; relay_signal $sig $job" "$sig"
    done
    # A hangup (the terminal closed): passed on as SIGTERM, which every launcher relays to the ranks alike (the ranks
    # take SIGHUP as SIGTERM too, and name SIGHUP in their lines: $signal_file, SPMD_RL_SIGNAL_FILE), and this
    # script lives on to wait and exit with the job's code; it died of it.
    # Under nohup it came ignored and stays so.
    # shellcheck disable=SC2064
    trap "signalled=\${signalled:-HUP}; echo HUP > \"$signal_file\"; relay_signal TERM $job" HUP
    while true; do   # a trapped signal ends `wait` early: wait again until the launcher itself has exited
        # (2>/dev/null: bash's own notice of a launcher killed by a signal, the whole command line; said below)
        wait "$job" 2>/dev/null && status=0 || status=$?
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
    local first_code=""
    if [[ $status != 0 ]] && compgen -G "$records/rank*.json" >/dev/null; then
        first_code=$("${PYTHON:-python}" -m spmd_rl.runtime.postmortem "$records" || true)
    fi
    ranks_code=$(cat "$exit_file" 2>/dev/null || true)
    if [[ $status != 0 ]]; then
        # An error without a signal: the job's code is its first failing rank's, from the failure records (rank 0's
        # own may be a knock-on: a communication error, or the launcher's SIGTERM), else rank 0's.
        if [[ -z $signalled ]]; then
            case $first_code in
                2 | 3 | 4) exit "$first_code" ;;
            esac
        fi
        case $ranks_code in
            2 | 3 | 4 | 75) exit "$ranks_code" ;;
            1[3-9][0-9] | 2[0-5][0-9]) [[ -n $signalled ]] && exit "$ranks_code" ;;
            "") if [[ -n $signalled ]]; then
                    echo "spmd_rl: $(basename "$0"): stopped by SIG$signalled while the ranks were starting" >&2
                    exit $((128 + $(kill -l "$signalled")))
                fi ;;
        esac
        local no_code='^(|129|1[3-9][0-9]|2[0-5][0-9])$'
        # No rank said anything: an interpreter that cannot run spmd_rl (its environment not activated) read as a
        # rank that ended before it could say why, or as mpirun killed by SIGABRT (fault pass 8, LS1 and LS2).
        if [[ -z $signalled && -z $first_code && $ranks_code =~ $no_code ]] && python_cannot_run_spmd_rl; then
            exit 2
        fi
        # The launcher itself died of a signal this script did not pass on (kill -9 of mpirun or of torchrun's
        # agent), and rank 0 left no code: the ranks went with it. Under torchrun they stop with a checkpoint when
        # their agent goes (rank 0 leaves 75, above); mpirun's are killed, and resume from the last checkpoint.
        # mpirun exits 128+N too when a rank died of signal N, but then it reported that rank ($reported_file).
        if [[ -z $signalled ]] && ((status > 128)) && [[ ! -s $reported_file && $ranks_code =~ $no_code ]]; then
            echo "spmd_rl: $(basename "$0"): the launcher (pid $job) was killed by SIG$(kill -l "$status")," \
                "not by this script, and the ranks ended with it: rerun the same command to resume from the last" \
                "checkpoint" >&2
            exit "$status"
        fi
        # Nobody asked the job to stop, no rank left a record, and rank 0 left no code or a signal's: a rank ended
        # without a word (killed, or dead before Python ran) before the process group formed, and the launcher
        # stopped the others. Its report, kept above (`spoke_awk`), names the rank; the job failed for another
        # rank, as a communication error (fault pass 5, J5 and J6: they exited 1, the code of our own bugs).
        if [[ -z $signalled && -z $first_code && $ranks_code =~ $no_code ]]; then
            echo "spmd_rl: $(basename "$0"): a rank ended before it could say why (killed, or dead before Python ran)" \
                "and the launcher stopped the others: the launcher's report above names it" >&2
            exit 3
        fi
    fi
    exit "$status"
}

# Whether ${PYTHON:-python} is missing or lacks torch, said in one line. Asked only after a job that failed without a
# word from its ranks, never before it starts: a python started before the traps widened the window in which a
# signal to the group ended this script without its line (3acbe91). find_spec: no import, a fraction of a second.
python_cannot_run_spmd_rl() {
    local python=${PYTHON:-python} why
    if ! command -v "$python" >/dev/null; then
        why="there is no '$python' on PATH"
    elif ! "$python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" 2>/dev/null; then
        why="$(command -v "$python") cannot import torch"
    else
        return 1
    fi
    echo "spmd_rl: $(basename "$0"): $why: activate the environment spmd_rl is installed in" \
        "(source .venv/bin/activate), or set PYTHON to its interpreter (PYTHON=.venv/bin/python)" >&2
}

# A rank count this host's memory cannot hold, refused in one line and exit 2 (fault pass 9, LS1: NPROC=99999
# started ranks until the OOM killer ended processes of other users). A rank takes 250 MiB or more (Python, torch).
# /proc/meminfo is read by bash itself: no process is started before the traps.
#   refuse_ranks_beyond_memory VARIABLE COUNT [ADVICE]
refuse_ranks_beyond_memory() {
    local variable=$1 count=$2 advice=${3:-} available_kb="" key value _
    while read -r key value _; do
        if [[ $key == MemAvailable: ]]; then available_kb=$value; break; fi
    done 2>/dev/null </proc/meminfo || true
    if [[ $count =~ ^[0-9]+$ && $available_kb =~ ^[0-9]+$ ]] && (( ${#count} > 6 || count * 256000 > available_kb ))
    then
        echo "spmd_rl: $(basename "$0"): $variable=$count: more ranks than this host's memory holds" \
            "($((available_kb / 1024)) MiB available, 250 MiB or more a rank: at most $((available_kb / 256000)));" \
            "lower $variable$advice" >&2
        exit 2
    fi
}
