#!/usr/bin/env bash
# torchrun on this node, or on several nodes (run this script once on every node).
#
#   NPROC=4 launch/torchrun.sh --config configs/ppo_cartpole.yaml
#   NPROC=4 launch/torchrun.sh --config configs/ppo_cartpole.yaml layout.mode=split layout.trainer=1 \
#       layout.inference=1 layout.env=2
#   # two nodes, on each of them:
#   NNODES=2 NPROC=8 MASTER_ADDR=node01 launch/torchrun.sh --config configs/ppo_halfcheetah.yaml
#
# Environment:
#   NPROC        ranks on this node (default 2)
#   MAX_RESTARTS times torchrun restarts all ranks after one failed (default 0)
#   NNODES       nodes taking part (default 1: --standalone, torchrun picks a free local port itself)
#   MASTER_ADDR  NNODES > 1: address of the node hosting the rendezvous (any one of them, the same everywhere)
#   MASTER_PORT  NNODES > 1: rendezvous port (default 29500)
#   RDZV_ID      NNODES > 1: a name shared by the nodes of one job and no other (default spmd_rl)
#   PYTHON       interpreter (default python on PATH); torchrun is run as `$PYTHON -m torch.distributed.run`
#                so the ranks use the same environment as the agent
#
# Stopping and resuming: Ctrl-C or SIGTERM to torchrun reaches every rank (torchrun passes it on); the ranks finish
# the iteration, save a checkpoint in <run dir>/checkpoints/ and exit 75, and so does this script (torchrun itself
# would exit 1). Rerun the same command to resume: the default run directory is the command's own
# (runs/<run.name>-<config digest>), whatever rendezvous id --standalone draws. With MAX_RESTARTS=N, a rank that dies (or exits with an
# error) makes torchrun restart all ranks, up to N times; they share the run id, so they resume from the latest
# checkpoint of the same directory and go on, losing the work since it (checkpoint.every_iterations / every_s).
# torchrun restarts on any exit code: a user error (exit 2, e.g. a config error) fails again in each attempt and its
# line is printed once per attempt (docs/failures.md).
set -euo pipefail
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
# What torchrun itself would refuse with a traceback, then read here as "a rank ended before it could say why" (exit 3):
# a rank count that is none (fault pass 8, LS1). Checked in bash alone: a signal here has no trap to meet yet.
if ! [[ $NPROC =~ ^([1-9][0-9]*|auto|cpu|gpu)$ ]]; then
    echo "spmd_rl: torchrun.sh: NPROC=$NPROC: give the number of ranks on this node (1 or more)" >&2
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
refuse_ranks_beyond_memory NPROC "$NPROC"   # a typo such as NPROC=99999 (fault pass 9, LS1)
if [[ $NNODES == 1 ]]; then
    rendezvous=(--standalone)
else
    : "${MASTER_ADDR:?NNODES=$NNODES: set MASTER_ADDR to the address of one node (the same on every node)}"
    rendezvous=(--rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
                --rdzv_id="${RDZV_ID:-spmd_rl}")
fi
# A signalled torchrun agent prints its SignalException traceback and exits 1 after the ranks stopped cleanly; rank 0
# leaves its own exit code in this file, so a clean stop ends this script with 75 and the stop line, no traceback
# (launch/common.sh).
make_exit_file
# A second signal while the agent handles the first (a signal to the whole process group reaches it directly and
# relayed by this script) chains a second traceback to the first: the chain is held to its end and dropped only if
# every exception in it is the agent's SignalException.
# When a rank fails or a signal comes, the agent logs each SIGTERM it sends on (dropped: the ranks' lines, or this
# script's, say what happened). After a failure it logs the failed exit code and raises ChildFailedError with a
# report of every rank's: 50 lines after the ranks' one line; a rank that does not end within the agent's shutdown
# timeout of its SIGTERM (30 s; a SIGSTOPped rank never does) is killed with a line saying so. Once rank 0 has left
# its code in $exit_file it has spoken for the job (its line or the job summary), so those are dropped too; a job
# whose rank 0 left nothing (it was killed, or died before Python ran) keeps them, the only account of what happened.
drop_signal_traceback() {   # every other line passes at once
    "${line_awk[@]}" -v exit_file="${exit_file:-/dev/null}" -v signal_file="${signal_file:-/dev/null}" \
        -v records="${failure_dir:-}" "$spoke_awk"'
         function finish() { if (real) print held; state = 0; fflush() }
         state == 3 { if (/^=+$/ && ++rules == 2) state = 0; next }   # the ChildFailedError report, to its end
         state == 2 && /^(During handling of the above exception|The above exception was the direct cause)/ {
             held = held "\n" $0; state = 1; next }
         state == 2 && /^$/ { held = held "\n" $0; next }
         state == 2 { finish() }
         /^Traceback \(most recent call last\):$/ {
             if (state == 1) held = held "\n" $0; else { held = $0; state = 1; real = 0 }
             next }
         state == 1 { held = held "\n" $0
                      if ($0 ~ /^([ \t]|$)/ || $0 ~ /^(During handling of the above exception|The above exception was the direct cause)/) next
                      if ($0 ~ /errors\.ChildFailedError: *$/ && !real && spoke()) { state = 3; rules = 0; next }
                      if ($0 !~ /SignalException: Process [0-9]+ got signal/) real = 1
                      state = 2; next }
         /^[IWE][0-9]+ [0-9:.]+ [0-9]+ ([^ ]*\/)?torch\/distributed\/elastic\/[a-z_\/]+\.py:[0-9]+\] (Sending process [0-9]+ closing signal SIG[A-Z]+|Received [0-9]+ death signal, shutting down workers)$/ {
             next }   # how the agent passes a signal or a failure on: the ranks, or this script, say what happened
         /^[IWE][0-9]+ [0-9:.]+ [0-9]+ ([^ ]*\/)?torch\/distributed\/elastic\/multiprocessing\/api\.py:[0-9]+\] (failed \(exitcode: -?[0-9]+\) local_rank: [0-9]+ |Unable to shutdown process [0-9]+ via )/ {
             if (spoke()) next }
         { print; fflush() }
         END { if (state == 3) state = 0; if (state) { real = real || state == 1; finish() } }' >&2
}
# Failing ranks leave their records in failure_dir (per attempt, with MAX_RESTARTS), so this script prints the job
# summary if rank 0 could not; one node only: records from some nodes alone would blame the others' ranks.
if [[ $NNODES == 1 ]]; then
    export SPMD_RL_FAILURE_DIR=$failure_dir
fi
# torchrun sets OMP_NUM_THREADS=1 for its workers unless it is already set, with a 3-line banner saying so: the
# same value, set here, without the banner.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The filter's pid is kept (a process substitution's is $! only right after it starts) so that this script ends
# after its last line; it reads until the agent and the ranks, its only writers once this shell closes its copy, exit.
# The filter ignores INT, TERM, USR1 and HUP: a signal sent to the whole process group (`timeout`, a terminal's
# Ctrl-C or hangup, Slurm) would otherwise end it first, and the ranks' last lines would go into a closed pipe.
exec {to_filter}> >(trap '' INT TERM USR1 HUP; drop_signal_traceback)
filter=$!
# The agent runs in a process group of its own (set -m), so a signal to this script's group reaches it once, passed
# on by wait_for_launcher, not twice: a second SIGTERM while it logs the first breaks its logging ("--- Logging
# error ---" and a stack) or chains a second traceback. Its stdin is /dev/null (a background group reading the
# terminal would be stopped), and with setpriv it gets SIGTERM, the checkpointed stop, if this script dies (even by
# kill -9; the ranks also watch the agent: spmd_rl/runtime/orphans.py).
orphan_guard=()
if command -v setpriv >/dev/null; then
    orphan_guard=(setpriv --pdeathsig TERM)
fi
set -m
SPMD_RL_EXIT_FILE=$exit_file SPMD_RL_SIGNAL_FILE=$signal_file "${orphan_guard[@]}" "${PYTHON:-python}" -m torch.distributed.run --nnodes="$NNODES" \
    --nproc_per_node="$NPROC" "${rendezvous[@]}" --max-restarts="${MAX_RESTARTS:-0}" -m spmd_rl.main "$@" \
    2>&"$to_filter" </dev/null &
job=$!
set +m
exec {to_filter}>&-
wait_for_launcher "$job" "$filter"   # the agent passes INT, TERM and USR1 on to every rank
