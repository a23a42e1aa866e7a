#!/usr/bin/env bash
# The GPU path on ONE GPU, in a few minutes: what a CPU machine cannot prove (issue 20, item 5).
#
#   bash benchmarks/gpu_check.sh            # from the repository root, with the project installed (.venv or PYTHON)
#
# Checks, each one line PASS/FAIL (the script exits 1 if any failed):
#   1. a one-process PPO run on cuda (train.deterministic=true) finishes, and its policy.pt holds CPU-loadable weights;
#   2. the same run stopped halfway (run.stop_after_iterations) and resumed equals it: metrics.jsonl (timings aside)
#      line for line and policy.pt byte for byte (checkpoints load to the CPU; state moves to cuda where applied);
#   3. SAC one process on cuda: its stop + resume equals the uninterrupted run (replay sampler, critics, optimizers);
#   4. the GPU-trained PPO run evaluates in a process that sees no GPU (CUDA_VISIBLE_DEVICES=);
#   5. a split layout with 2 GPU ranks (trainer + inference) on this single GPU is refused before start with exit 2;
#   6. large policies: one-process PPO with train.parallel=fsdp (FSDP2 over a one-rank NCCL group) and
#      train.precision=bf16 on cuda, stopped halfway and resumed from its sharded (DCP) checkpoint, equals the
#      uninterrupted run; its policy.pt evaluates without a GPU;
#   7. the same with policy.class=transformer and activation checkpointing (bf16 on CUDA through autocast).
# What needs two GPUs or more is printed at the end (NCCL refuses two ranks on one GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python)}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/spmd_gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
failed=0

say() { printf '%-4s %s\n' "$1" "$2"; [[ $1 == FAIL ]] && failed=1; return 0; }
run() { "$PYTHON" -m spmd_rl.main "$@" log.progress=false log.tensorboard=false > "$WORK/last.log" 2>&1; }
same_run() {  # metrics (timings aside) and final weights of two run directories
    "$PYTHON" - "$1" "$2" <<'EOF'
import json, sys, torch
def records(d):
    out = []
    for line in open(f"{d}/metrics.jsonl"):
        r = json.loads(line)
        out.append({k: v for k, v in r.items() if not k.startswith("time_") and k not in ("sps", "wall_s", "cpu_s")})
    return out
a, b = sys.argv[1:]
pa, pb = (torch.load(f"{d}/policy.pt", map_location="cpu", weights_only=True) for d in (a, b))
ok = records(a) == records(b) and pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
sys.exit(0 if ok else 1)
EOF
}

halves_equal() {  # NAME HALF ARGS...: the run stopped after HALF iterations (exit 75) and resumed equals $WORK/NAME_full
    local name=$1 half=$2; shift 2
    run "$@" run.dir="$WORK/${name}_parts" run.stop_after_iterations="$half"
    [[ $? == 75 ]] && run "$@" run.dir="$WORK/${name}_parts" && [[ -f $WORK/${name}_parts/finished.json ]] \
        && same_run "$WORK/${name}_full" "$WORK/${name}_parts"
}

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "no CUDA device visible"; exit 2; }
"$PYTHON" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"

PPO=(--config configs/ppo_cartpole.yaml train.total_steps=20480 train.device=cuda train.deterministic=true)
if run "${PPO[@]}" run.dir="$WORK/ppo_full" && grep -q "device cuda" "$WORK/last.log"; then
    say PASS "1. one-process PPO on cuda finished ($(grep -o 'done: .*steps/s)' "$WORK/last.log"))"
else
    say FAIL "1. one-process PPO on cuda: $(tail -n 3 "$WORK/last.log")"
fi

if halves_equal ppo 40 "${PPO[@]}"; then  # 80 iterations of 256 env steps
    say PASS "2. PPO stop + resume on cuda equals the uninterrupted run (metrics and weights)"
else
    say FAIL "2. PPO stop + resume on cuda differs or failed: $(tail -n 3 "$WORK/last.log")"
fi

SAC=(--config configs/sac_pendulum.yaml train.total_steps=3000 algo.learning_starts=500 train.device=cuda
     train.deterministic=true)
run "${SAC[@]}" run.dir="$WORK/sac_full"
if halves_equal sac 187 "${SAC[@]}"; then  # 375 iterations of 8 env steps
    say PASS "3. SAC stop + resume on cuda equals the uninterrupted run"
else
    say FAIL "3. SAC on cuda: $(tail -n 3 "$WORK/last.log")"
fi

if CUDA_VISIBLE_DEVICES= "$PYTHON" -m spmd_rl.evaluate "$WORK/ppo_full" --episodes 3 --deterministic > "$WORK/eval.log" 2>&1
then
    say PASS "4. the GPU-trained run evaluates without a GPU: $(tail -n 1 "$WORK/eval.log")"
else
    say FAIL "4. evaluation without a GPU: $(tail -n 2 "$WORK/eval.log")"
fi

"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=3 -m spmd_rl.main --config configs/ci_tiny.yaml \
    layout.mode=split layout.trainer=1 layout.inference=1 layout.env=1 train.device=cuda run.dir="$WORK/refused" \
    > "$WORK/split.log" 2>&1
if grep -q "compute on a GPU" "$WORK/split.log" && [[ ! -d $WORK/refused ]]; then
    say PASS "5. 2 GPU ranks on 1 GPU refused before start: $(grep -o 'spmd_rl: .*' "$WORK/split.log" | head -n 1)"
else
    say FAIL "5. 2 GPU ranks on 1 GPU: $(tail -n 3 "$WORK/split.log")"
fi

LARGE=(--config configs/ppo_cartpole.yaml train.total_steps=8192 train.device=cuda train.deterministic=true
       train.parallel=fsdp train.precision=bf16)
run "${LARGE[@]}" run.dir="$WORK/fsdp_full"
if halves_equal fsdp 16 "${LARGE[@]}" \
    && CUDA_VISIBLE_DEVICES= "$PYTHON" -m spmd_rl.evaluate "$WORK/fsdp_full" --episodes 2 > "$WORK/eval.log" 2>&1; then
    say PASS "6. fsdp + bf16 on cuda: sharded stop + resume equals the uninterrupted run; evaluates without a GPU"
else
    say FAIL "6. fsdp + bf16 on cuda: $(tail -n 3 "$WORK/last.log")"
fi

if run "${LARGE[@]}" policy.class=transformer train.activation_checkpointing=true run.dir="$WORK/transformer"; then
    say PASS "7. transformer policy, fsdp + bf16 + activation checkpointing on cuda ($(grep -o 'done: .*steps/s)' "$WORK/last.log"))"
else
    say FAIL "7. transformer policy on cuda: $(tail -n 3 "$WORK/last.log")"
fi

cat <<'EOF'
Not checked here (needs 2 GPUs or more: NCCL refuses two ranks on one GPU):
  - colocated 2 ranks (DDP over NCCL) and its resume;
  - split layouts: weight broadcast over NCCL, the inference rank's CUDA forward passes, weights.verify_every;
  - the async engine at lag 0 equal to sync, and SAC async (staged weights polled over NCCL);
  - the NCCL group timeout (a minute past dist.timeout_s) after a stopped rank;
  - FSDP over 2+ trainers on NCCL, the weight sync from shards to inference ranks (ShardedWeightSource: every
    trainer's rows point to point over NCCL, bf16 on the wire), SAC on fsdp, resharding, and
    benchmarks/large_policy.py's numbers on GPUs.
EOF
exit $failed
