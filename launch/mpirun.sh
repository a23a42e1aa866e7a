#!/usr/bin/env bash
# mpirun (Open MPI 4, as packaged by Debian 12 / Ubuntu 22.04): NP ranks on this host, or on the hosts of
# HOSTFILE. mpi4py lets rank 0 pick the address and a free port for torch.distributed; MPI carries nothing else.
#
#   NP=4 launch/mpirun.sh --config configs/ppo_cartpole.yaml
#   NP=16 HOSTFILE=hosts.txt MASTER_ADDR=10.0.0.1 launch/mpirun.sh --config configs/ppo_halfcheetah.yaml
#
# Environment:
#   NP           ranks in total (default 2)
#   HOSTFILE     Open MPI host file ("node01 slots=8" per line); unset: all ranks on this host
#   MASTER_ADDR  several hosts: rank 0's address, when its host name does not resolve to it (forwarded with -x)
#   MPIRUN_ARGS  further mpirun flags, word-split (e.g. "--mca btl_tcp_if_include eth0")
#   PYTHON       interpreter (default python on PATH; must exist at the same path on every host)
#
# Stopping and resuming: Ctrl-C, SIGTERM or SIGUSR1 to mpirun reaches every rank (mpirun passes SIGINT and SIGTERM
# on as SIGTERM, SIGUSR1 as it is); the ranks finish the iteration, save a checkpoint in <run dir>/checkpoints/ and
# exit 75, and so does this script. After such a stop, or a crash (a rank killed or a host lost: mpirun then stops the
# other ranks), rerun the same command: it resumes from the latest checkpoint (run.resume=auto), losing at most the
# work since it (checkpoint.every_iterations / checkpoint.every_s): the default run directory is the command's own
# (runs/<run.name>-<config digest>), so the rerun finds it. mpirun does not restart ranks by itself.
set -euo pipefail
NP=${NP:-2}
# What mpirun would refuse with its usage box, then read here as a rank that "ended before it could
# say why": a rank count that is none (fault pass 8, LS2). Checked in bash alone: a signal here has no trap to meet yet.
if ! [[ $NP =~ ^[0-9]+$ ]]; then
    echo "spmd_rl: mpirun.sh: NP=$NP: give the number of ranks (1 or more)" >&2
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [[ -z ${HOSTFILE:-} ]]; then   # all NP ranks on this host: a count its memory cannot hold is refused
    refuse_ranks_beyond_memory NP "$NP" ", or give a HOSTFILE"
fi
flags=(
    -n "$NP"
    --bind-to none                       # Open MPI binds each rank to one core by default; torch and the envs
                                         # of a rank use threads, which would then all share that core
    --oversubscribe                      # allow more ranks than cores: env and inference ranks mostly wait
    -x "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"   # torchrun sets 1, mpirun does not: N ranks x all-core
                                                 # thread pools thrash
    --mca odls_base_sigkill_timeout 3    # when a rank dies mpirun SIGTERMs the rest, and SIGKILLs them 1 s later
                                         # by default: too soon for some to leave the failure record the job
                                         # summary needs (their lines and records take well under a second)
)
if [[ $(id -u) == 0 ]]; then
    flags+=(--allow-run-as-root)         # containers run as root; Open MPI refuses root without this flag
fi
if [[ -n ${HOSTFILE:-} ]]; then
    flags+=(--hostfile "$HOSTFILE")
else
    # One host: MPI carries only the rendezvous, so no TCP transport (the ranks would each listen on every
    # interface), and mpirun's own daemon channel on loopback. mpirun still opens two listeners of its own (PMIx).
    flags+=(--mca btl self,vader --mca oob_tcp_if_include lo)
fi
if [[ -n ${MASTER_ADDR:-} ]]; then
    flags+=(-x MASTER_ADDR)
fi
# rank 0 leaves its exit code in this file (it runs on this host unless HOSTFILE puts it elsewhere), so a clean stop
# ends this script with 75 as it ends every rank (launch/common.sh).
make_exit_file
flags+=(-x "SPMD_RL_EXIT_FILE=$exit_file" -x "SPMD_RL_SIGNAL_FILE=$signal_file")   # the lines name a SIGHUP relayed as TERM
if [[ -z ${HOSTFILE:-} ]]; then
    # failing ranks leave their records in this directory, so this script prints the job summary when mpirun
    # killed rank 0 before it could; one host only: records from some hosts alone would blame the others' ranks
    flags+=(-x "SPMD_RL_FAILURE_DIR=$failure_dir")
fi
# After a rank exits non-zero (75 too: a checkpointed stop that one rank was signalled for) mpirun prints a box or
# two between rules of dashes saying which process "exited with non-zero status": 5 to 11 lines after the ranks'
# one line. Once rank 0 has left its code in $exit_file it has spoken for the job (its line, the stop line or the
# job summary), so such boxes are dropped; a job whose rank 0 left nothing (killed, or dead before Python ran) keeps
# them, the only account of what happened. mpirun's "Forwarding signal N to job" (the signal this script passed on,
# which the ranks acknowledge themselves) is dropped. Every other line passes at once. A report of a rank's end
# ("mpirun noticed that process rank ...") is marked in $reported_file: mpirun exits 128+N after it as after its
# own kill by signal N, which wait_for_launcher tells apart so.
drop_exit_status_boxes() {
    "${line_awk[@]}" -v exit_file="$exit_file" -v signal_file="$signal_file" -v reported_file="$reported_file" \
        -v records="$failure_dir" "$spoke_awk"'
         /^mpirun noticed that process rank / { printf "1" > reported_file; close(reported_file) }
         /^mpirun: Forwarding signal [0-9]+ to job$/ { next }
         /^--------------------+$/ { if (!boxed) { boxed = 1; held = $0; next }
                      held = held "\n" $0; boxed = 0
                      if (!(held ~ /non-zero/ && spoke())) print held
                      fflush(); next }
         boxed { held = held "\n" $0; next }
         { print; fflush() }
         END { if (boxed) print held }' >&2
}
exec {to_filter}> >(trap '' INT TERM USR1 HUP; drop_exit_status_boxes)
filter=$!
# mpirun runs in a process group of its own (set -m), so a signal to this script's group (a terminal's Ctrl-C,
# `timeout`, kill -TERM -PGID) reaches it once, passed on below, not twice: a second SIGTERM makes mpirun kill the
# ranks at once, without their checkpoint. Its stdin is /dev/null (a background group reading the terminal would be
# stopped), and with setpriv it gets SIGTERM, the checkpointed stop, if this script dies (even by kill -9).
orphan_guard=()
if command -v setpriv >/dev/null; then
    orphan_guard=(setpriv --pdeathsig TERM)
fi
set -m
# shellcheck disable=SC2086  # MPIRUN_ARGS is a list of flags
"${orphan_guard[@]}" mpirun "${flags[@]}" ${MPIRUN_ARGS:-} "${PYTHON:-python}" -m spmd_rl.main "$@" \
    2>&"$to_filter" </dev/null &
launcher=$!
set +m
exec {to_filter}>&-
wait_for_launcher $launcher "$filter"   # passes INT, TERM and USR1 on to mpirun, which passes them on to every rank
