#!/bin/sh
# spec15 helper, session 15 (issue 15: the adaptive policy never slower than off at batch 1-64).
# Run from the repo root of the lead's checkout:   sh build/gpu-spec15/run.sh OUT_DIR
# Staged in build/gpu-spec15/: bins.tar.xz (pdserve and test_gpu_spec of this branch, stripped),
# COMMIT, LIMIT. Models: build/gpu-lead/llama-3-8b (8B config + the kjv tokenizer, dummy weights),
# build/gpu-lead/models.tar.xz for test_gpu_spec. Libraries: /tmp/gpulib/lib (the lead's wrapper).
# One binary; the policy is switched per bench-spec process:
#   N (new)  the binary's defaults (session 15: PD_SPEC_EVIDENCE=1, the drain verdict from the pooled
#            acceptance's lower bound too, uninformed requests explore at k = 1, shape prices confirmed)
#   O (old)  PD_SPEC_EVIDENCE=0: session 14's policy (main 0b86b1a's behaviour)
#   Q        N with PD_SPEC_PROBE_SHARE=0.0005 (probes 5x rarer: what the probes cost in a draining batch)
#   E6       N with PD_SPEC_PRIOR_EVIDENCE=6 (call 1's value; the default is 4 from call 3, 2 in call 2)
# Draft fixture: --speculative-dummy-layers 1 --dummy-residual-scale 1:EPS (0.1: acceptance ~0.2,
# "nonpay"; 0.05: ~0.5-0.6, "pay"), --num-speculative-tokens 4, random prompts of 32 tokens.
# DT3 = one plain engine (bench-spec's baseline: --modes must start with off), then three adaptive
# engines each followed by its paused twin (a/p = the policy's effect on the same engine). bench-spec
# runs, per batch, a warm-up run of every entry and then reps rounds, and prints every summary at the
# end (a run cut by its timeout prints nothing). The 48-token non-paying runs start with batch 8 (as
# session 14's final check: the 0.967 engine was a batch-8-first one).
# Parts (env PARTS, in order; BUDGET s):
#   n48_N / n48_O  nonpay, 48 tokens, batches 8,32,64, reps 2, DT3 (n48_N2: N again, n48_Q: Q)
#   nL_N / nL_O    nonpay, 128 tokens, batches ${LB:-1,8,32,64}, reps 2, DT2 (two adaptive engines)
#   p_N / p_O      pay, 48 tokens, batches 1,8,32,64, reps 2, off,adaptive,off,adaptive
#   copy           ngram copy workload P 0.7 (fixed and adaptive), batch 1, 4 serial requests of 96 tokens
#   test           test_gpu_spec (greedy byte-identical with speculation on the card)
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-spec15}
T=/tmp/spec15
t0=$(date +%s)
mkdir -p $T && tar xJf $D/bins.tar.xz -C $T
BIN=${BIN:-$T/pdserve} DEV=${DEV:-cuda}  # (BIN, DEV, M, LIMS: a check of the command lines on the CPU)
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/tmp/gpulib/lib} PD_SPEC_STATS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null
cat $D/COMMIT
left() { echo $(( ${BUDGET:-192} - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
M=${M:-build/gpu-lead/llama-3-8b}
W="--random-prompt 32 --random-prompts 8"
spec() {  # name variant limit args...
  n=$1; v=$2; l=$3; shift 3
  # (a bench-spec cut by its timeout prints nothing: run a part only where its whole limit fits)
  [ "$(left)" -lt "$l" ] && { echo "== $n skipped: budget ($(left) s left, $l s needed)"; return; }
  case $v in
    N) E="PD_SPEC_STATS=1";;
    O) E="PD_SPEC_EVIDENCE=0";;
    Q) E="PD_SPEC_PROBE_SHARE=0.0005";;
    E6) E="PD_SPEC_PRIOR_EVIDENCE=6";;
  esac
  env $E timeout $(lim ${LIMS:-$l}) $BIN bench-spec --device $DEV --model $M --load-format dummy "$@" --json "$OUT/$n.json" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  echo "== $n $E rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "summary" "$OUT/$n.txt" | sed 's/ (the others.*//' | cut -c1-900
  grep -E "spec stats: [0-9]+ steps|spec stats: drain model|spec stats: batch [0-9]+: [0-9]+ steps judged" "$OUT/$n.err" | sed 's/.*spec stats: //' | cut -c1-400
}
draft() {  # name variant eps tokens batches reps limit modes
  spec $1 $2 $7 --speculative-method draft --speculative-model $M --speculative-dummy-layers 1 --dummy-residual-scale 1:$3 \
    $W --num-speculative-tokens 4 --max-tokens $4 --batches $5 --reps $6 --modes $8
}
DT3=off,adaptive,paused,adaptive,paused,adaptive,paused  # 4 engines (8B dummy ~16 GB each); off first: bench-spec's baseline
DT2=off,adaptive,paused,adaptive,paused
testgpu() {
  if [ "$(left)" -gt 12 ]; then
    mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
    PD_MODELS_DIR=$T/models timeout $(lim 30) $T/test_gpu_spec > "$OUT/test_gpu_spec.txt" 2>&1
    echo "== test_gpu_spec rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "passed|FAIL" "$OUT/test_gpu_spec.txt" | tail -4
  else echo "== test_gpu_spec skipped: budget"; fi
}
# round 1 (call spec15-1, binaries b5a8567, LIMIT 190, BUDGET 182): n48_N n48_O p_N nL_N copy test
# round 2 (call spec15-2, binaries da62a34, LIMIT 200, BUDGET 192; PD_SPEC_PRIOR_EVIDENCE 6 -> 2):
#   n48_N n48_O n48_Q n48_N2 p_N test
# round 3 (LIMIT 200, BUDGET 192; PD_SPEC_PRIOR_EVIDENCE 4, a knob): n48_N p_N n48_N2 p_N2 test nL_N (b8,32,64)
PARTS=${PARTS:-n48_N p_N n48_N2 p_N2 test nL_N}
for part in $PARTS; do
  case $part in
    n48_N) draft n48_N N 0.1 48 8,32,64 2 40 $DT3;;
    n48_O) draft n48_O O 0.1 48 8,32,64 2 40 $DT3;;
    n48_N2) draft n48_N2 N 0.1 48 8,32,64 2 40 $DT3;;
    n48_Q) draft n48_Q Q 0.1 48 8,32,64 2 40 $DT3;;
    nL_N) draft nL_N N 0.1 128 ${LB:-8,32,64} 2 48 $DT2;;
    nL_O) draft nL_O O 0.1 128 ${LB:-1,8,32,64} 2 66 $DT2;;
    p_N) draft p_N N 0.05 48 1,8,32,64 2 30 off,adaptive,off,adaptive;;
    p_O) draft p_O O 0.05 48 1,8,32,64 2 30 off,adaptive,off,adaptive;;
    p_N2) draft p_N2 N 0.05 48 1,8,32,64 2 30 off,adaptive,off,adaptive;;
    p_E6) draft p_E6 E6 0.05 48 1,8,32,64 2 30 off,adaptive,off,adaptive;;
    copy) spec copy N 14 --dummy-residual-scale 0:0 --copy-chain 0.7 --random-prompt 32 --random-prompts 4 --num-speculative-tokens 8 \
            --max-tokens 96 --batches 1 --serial 4 --reps 1 --modes off,ngram:fixed,ngram:adaptive;;
    test) testgpu;;
  esac
done
echo "total $(( $(date +%s) - t0 )) s"
