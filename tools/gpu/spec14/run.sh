#!/bin/sh
# spec14 helper, session 14 (issue 15: the adaptive policy never slower than off at batch 1-64).
# Run from the repo root of the lead's checkout:   sh build/gpu-spec14/run.sh OUT_DIR
# Staged in build/gpu-spec14/: bins.tar.xz (pdserve and test_gpu_spec of this branch, stripped),
# COMMIT, LIMIT. Models: build/gpu-lead/llama-3-8b (8B config + the kjv tokenizer, dummy weights),
# build/gpu-lead/models.tar.xz for test_gpu_spec. Libraries: /tmp/gpulib/lib (the lead's wrapper).
# One binary; the policy is switched per bench-spec process:
#   N (new)  the binary's defaults. Call 1 (binaries 6d1601c): PD_SPEC_DRAIN=1 PD_SPEC_CALIB=1
#            PD_SPEC_DRAIN_HOLD=8 set by env (drain model + realized-gain check + drain refusals judged
#            again after 8 steps); from call 2 (binaries with those defaults and PD_SPEC_POP_REQ=1: a new
#            request's prior from finished requests) no env.
#   O (old)  PD_SPEC_DRAIN=0 PD_SPEC_CALIB=0 (+ PD_SPEC_POP_REQ=0 from call 2): session 13's policy
# Draft fixture: --speculative-dummy-layers 1 --dummy-residual-scale 1:EPS (0.1: acceptance ~0.2,
# "nonpay"; 0.05: ~0.5-0.6, "pay"), --num-speculative-tokens 4, random prompts of 32 tokens.
# DT3 = one plain engine (bench-spec's baseline: --modes must start with off; call 2's AP3 without it
# failed at once), then three adaptive engines each followed by its paused twin (a/p = the policy's
# effect on the same engine). bench-spec runs, per batch, a warm-up run
# of every entry and then reps rounds, and prints every summary at the end (a run cut by its
# timeout prints nothing: call 1's nL_N).
# Parts (env PARTS, in order; BUDGET s):
#   nL_N / nL_O  nonpay, 128 tokens, batches ${LB:-8,32,64} (nL_O: ${LBO:-32}), reps ${LR:-2}, DT3
#   n_N / n_O    nonpay, 48 tokens, batches 1/8/32/64, reps 2, DT3
#   p_N / p_O    pay, 48 tokens, batches 1/8/32/64, reps 2, off,adaptive,off,adaptive
#   free_N       ngram / lookahead adaptive (with paused twins), 48 tokens, reps 2
#   test         test_gpu_spec (greedy byte-identical with speculation on the card)
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-spec14}
T=/tmp/spec14
t0=$(date +%s)
mkdir -p $T && tar xJf $D/bins.tar.xz -C $T
BIN=${BIN:-$T/pdserve} DEV=${DEV:-cuda}  # (BIN, DEV, M, LIMS: a check of the command lines on the CPU)
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/tmp/gpulib/lib} PD_SPEC_STATS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cat $D/COMMIT
left() { echo $(( ${BUDGET:-114} - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
M=${M:-build/gpu-lead/llama-3-8b}
W="--random-prompt 32 --random-prompts 8"
spec() {  # name variant limit args...
  n=$1; v=$2; l=$3; shift 3
  # (a bench-spec cut by its timeout prints nothing: run a part only where its whole limit fits)
  [ "$(left)" -lt "$l" ] && { echo "== $n skipped: budget ($(left) s left, $l s needed)"; return; }
  case $v in
    N) E="PD_SPEC_STATS=1";;
    U) E="PD_SPEC_CALIB_TOK=0";;
    O) E="PD_SPEC_DRAIN=0 PD_SPEC_CALIB=0 PD_SPEC_POP_REQ=0";;
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
FT=off,ngram:adaptive,paused,lookahead:adaptive,paused
testgpu() {
  if [ "$(left)" -gt 12 ]; then
    mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
    PD_MODELS_DIR=$T/models timeout $(lim 30) $T/test_gpu_spec > "$OUT/test_gpu_spec.txt" 2>&1
    echo "== test_gpu_spec rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "passed|FAIL" "$OUT/test_gpu_spec.txt" | tail -4
  else echo "== test_gpu_spec skipped: budget"; fi
}
# round 1 (call 1, binaries 6d1601c, LIMIT 180, BUDGET 172, DT3): nL_N p_N p_O test nL_O n_N
# round 2 (call 2, binaries 08830f7, LIMIT 170, BUDGET 162, AP3): nL_N p_N n_N nL_O (only p_N ran)
# round 2b (call 3, binaries 86bdd89, LIMIT 170, BUDGET 164, DT3): nL_N p_N n_N nL_O (nL_O skipped)
# round 4 (call 4, LIMIT 120, BUDGET 114): the token correction of the drain model's acceptance
# (PD_SPEC_CALIB_TOK, default on = T) against call 3's policy (U = PD_SPEC_CALIB_TOK=0), alternated:
# nb_T nb_U (nonpay, 48 tokens, b1/8), p_T (pay b8/32/64), test (test_gpu_spec on the final code)
PARTS=${PARTS:-nb_T nb_U p_T test}
for part in $PARTS; do
  case $part in
    nL_N) draft nL_N N 0.1 128 ${LB:-8,32,64} ${LR:-2} 85 $DT3;;
    nL_O) draft nL_O O 0.1 128 ${LBO:-32} ${LR:-2} 32 $DT3;;
    n_N) draft n_N N 0.1 48 1,8,32,64 2 45 $DT3;;
    n_O) draft n_O O 0.1 48 1,8,32,64 2 40 $DT3;;
    p_N) draft p_N N 0.05 48 1,8,32,64 2 30 off,adaptive,off,adaptive;;
    p_O) draft p_O O 0.05 48 1,8,32,64 2 30 off,adaptive,off,adaptive;;
    free_N) spec free_N N 40 --dummy-residual-scale 1:0.02 $W --num-speculative-tokens 4 --max-tokens 48 --batches 1,8,32,64 --reps 2 --modes $FT;;
    nb_T) draft nb_T N 0.1 48 1,8 2 32 $DT3;;
    nb_U) draft nb_U U 0.1 48 1,8 2 32 $DT3;;
    p_T) draft p_T N 0.05 48 8,32,64 2 24 off,adaptive,off,adaptive;;
    nL8_T) draft nL8_T N 0.1 128 8 2 26 $DT3;;
    test) testgpu;;
  esac
done
echo "total $(( $(date +%s) - t0 )) s"
