#!/bin/sh
# spec13 helper, session 13 (issue 15: the adaptive policy never slower than off at batch 1-64, the
# draining-batch finish-time model). Run from the repo root of the lead's checkout:
#   sh build/gpu-spec13/run.sh OUT_DIR      (LIMIT in build/gpu-spec13/LIMIT)
# Staged in build/gpu-spec13/: bins.tar.xz (pdserve and test_gpu_spec of this branch, stripped),
# COMMIT. Models: build/gpu-lead/models.tar.xz (kjv-llama-1m, golden; kjv-llama-6m is the tracked
# models/), build/gpu-lead/llama-3-8b (the 8B config + the kjv tokenizer), dummy weights. Libraries:
# /tmp/gpulib/lib (the lead's wrapper).
# One binary; the drain model is switched by PD_SPEC_DRAIN=1 (the default) / 0 per bench-spec process,
# the processes alternating. Every draft run: --speculative-dummy-layers 1 --dummy-residual-scale
# 1:EPS (0.1: acceptance ~0.2, "nonpay"; 0.05: ~0.5-0.6, "pay"), --num-speculative-tokens 4, random
# prompts of 32 tokens. Modes DT3 = three adaptive engines, each followed by its paused twin (the same
# engine with speculation paused: "a/p" is the policy's effect without the spread between engines),
# after one plain engine (the cross-engine ratio; its band is that engine's own runs).
# Parts (env PARTS, in order; BUDGET s):
#   nD1 / nD0     nonpay, 48 tokens, batches 1/8/32/64, reps 2, DT3, drain on / off
#   nLD1 / nLD0   nonpay, 128 tokens, batch ${L_B:-8}, reps 2, DT3, drain on / off
#   pD1 / pD0     pay, 48 tokens, batches 1/8/32/64, reps 2, off,adaptive,off,adaptive
#   free          ngram / lookahead adaptive (with paused twins), 48 tokens, reps 2, drain on
#   test          test_gpu_spec (greedy byte-identical with speculation on the card)
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-spec13}
T=/tmp/spec13
t0=$(date +%s)
mkdir -p $T && tar xJf $D/bins.tar.xz -C $T
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/tmp/gpulib/lib} PD_SPEC_STATS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cat $D/COMMIT
left() { echo $(( ${BUDGET:-172} - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
M=${M:-build/gpu-lead/llama-3-8b}
W="--random-prompt 32 --random-prompts 8"
spec() {  # name drain limit args...
  n=$1; dr=$2; l=$3; shift 3
  [ "$(left)" -lt 15 ] && { echo "== $n skipped: budget"; return; }
  PD_SPEC_DRAIN=$dr timeout $(lim $l) $T/pdserve bench-spec --device cuda --model $M --load-format dummy "$@" --json "$OUT/$n.json" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  echo "== $n PD_SPEC_DRAIN=$dr rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "ready in|summary" "$OUT/$n.txt" | sed 's/ (the others.*//; s/ready in/ready/' | cut -c1-900
  grep -E "spec stats: [0-9]+ steps|spec stats: drain" "$OUT/$n.err" | sed 's/.*spec stats: //' | cut -c1-300
}
draft() {  # name drain eps tokens batches reps limit modes
  spec $1 $2 $7 --speculative-method draft --speculative-model $M --speculative-dummy-layers 1 --dummy-residual-scale 1:$3 \
    $W --num-speculative-tokens 4 --max-tokens $4 --batches $5 --reps $6 --modes $8
}
DT3=off,adaptive,paused,adaptive,paused,adaptive,paused  # 4 engines (8B dummy ~16 GB each): 5 would not fit
FT=off,ngram:adaptive,paused,lookahead:adaptive,paused,off
testgpu() {
  if [ "$(left)" -gt 12 ]; then
    mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
    PD_MODELS_DIR=$T/models timeout $(lim 30) $T/test_gpu_spec > "$OUT/test_gpu_spec.txt" 2>&1
    echo "== test_gpu_spec rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "passed|FAIL" "$OUT/test_gpu_spec.txt" | tail -4
  else echo "== test_gpu_spec skipped: budget"; fi
}
# round 1 (call 1, binaries 01e538d): nD1 nD0 test pD1 nLD1 nLD0
# round 2 (binaries 13608a2: pooled acceptance in the drain model): pD1 nD1 pD0 test nLD1 free nD0
# round 3 (binaries 7d65e3d: the drain margin 0.025), BUDGET 172, LIMIT 180: pD1 nD1 test nLD1 pD0 nD0
PARTS=${PARTS:-pD1 nD1 test nLD1 pD0 nD0}
for part in $PARTS; do
  case $part in
    nD1) draft nD1 1 0.1 48 1,8,32,64 2 50 $DT3;;
    nD0) draft nD0 0 0.1 48 1,8,32,64 2 50 $DT3;;
    nLD1) draft nLD1 1 0.1 128 ${L_B:-8} 2 40 $DT3;;
    nLD0) draft nLD0 0 0.1 128 ${L_B:-8} 2 40 $DT3;;
    pD1) draft pD1 1 0.05 48 1,8,32,64 2 30 off,adaptive,off,adaptive;;
    pD0) draft pD0 0 0.05 48 1,8,32,64 2 30 off,adaptive,off,adaptive;;
    free) spec free 1 40 --dummy-residual-scale 1:0.02 $W --num-speculative-tokens 4 --max-tokens 48 --batches 1,8,32,64 --reps 2 --modes $FT;;
    test) testgpu;;
  esac
done
echo "total $(( $(date +%s) - t0 )) s"
