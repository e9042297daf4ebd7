#!/bin/sh
# spec12 helper, session 12 (issue 15: the adaptive policy never slower than off at batch 1-64).
# Run from the repo root of the lead's checkout: sh build/gpu-spec12/run.sh OUT_DIR (LIMIT in
# build/gpu-spec12/LIMIT). Staged in build/gpu-spec12/: bins.tar.xz (pdserve = this branch,
# pdserve.main = main's, test_gpu_spec; stripped), models.tar.xz (kjv-llama-1m, golden; kjv-llama-6m
# is the tracked models/), COMMIT. Libraries: /tmp/gpulib/lib (the lead's wrapper). Model: the 8B
# shape with a tokenizer, build/gpu-lead/llama-3-8b of the lead's tree (bench/configs/llama-3-8b's
# config + the kjv tokenizer: bench-spec loads a tokenizer), dummy weights.
# Parts (env PARTS, in this order; BUDGET s; every bench-spec run interleaves plain engines with the
# speculative ones: --modes off,X,off,X, --reps R; the ratio is to the plain runs' median, the band
# their spread; with TWIN=1 (call 3 on) each speculative engine is also timed with speculation
# paused ("paused": the same engine's plain steps), whose ratio active / paused is the policy's cost
# without the ~1% spread between engines that call 2 showed):
#   nonpay     draft fixture at a non-paying acceptance (EPS 0.1, ~0.2): adaptive vs off, batch 1/8/32/64
#   pay        draft fixture where drafting pays (EPS 0.05, ~0.5): adaptive vs off, batch 1/8/32/64
#   free       ngram and lookahead adaptive vs off on random prompts (no repetition: nothing to find)
#   nonpaymain main's binary on nonpay at batch 32/64 (the same card, the same call)
#   nonpayL, freeL, payL   the same parts with ${L_TOK:-128} tokens per request
#   test       test_gpu_spec (greedy byte-identical with speculation on the card)
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-spec12}
T=/tmp/spec12
t0=$(date +%s)
mkdir -p $T && tar xJf $D/bins.tar.xz -C $T
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/tmp/gpulib/lib} PD_SPEC_STATS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cat $D/COMMIT
left() { echo $(( ${BUDGET:-235} - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
M=${M:-build/gpu-lead/llama-3-8b}
W="--random-prompt 32 --random-prompts 8"
spec() {  # name binary limit args...
  n=$1; b=$2; l=$3; shift 3
  [ "$(left)" -lt 15 ] && { echo "== $n skipped: budget"; return; }
  timeout $(lim $l) $T/$b bench-spec --device cuda --model $M --load-format dummy "$@" --json "$OUT/$n.json" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  echo "== $n rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "ready in|summary" "$OUT/$n.txt" | sed 's/ (the others.*//; s/ready in/ready/' | cut -c1-600
  grep -E "spec stats: [0-9]+ steps|draft forwards: [0-9]" "$OUT/$n.err" | sed 's/.*spec stats: //' | cut -c1-400
}
draft() {  # name binary eps tokens batches reps limit [modes]
  spec $1 $2 $7 --speculative-method draft --speculative-model $M --speculative-dummy-layers 1 --dummy-residual-scale 1:$3 \
    $W --num-speculative-tokens 4 --max-tokens $4 --batches $5 --reps $6 --modes ${8:-off,adaptive,off,adaptive}
}
free() {  # name tokens batches reps limit [modes]
  spec $1 pdserve $5 --dummy-residual-scale 1:0.02 $W --num-speculative-tokens 4 --max-tokens $2 --batches $3 --reps $4 \
    --modes ${6:-off,ngram:adaptive,lookahead:adaptive,off}
}
DT=off,adaptive,paused,off,adaptive,paused           # the draft engines with their paused twins
FT=off,ngram:adaptive,paused,lookahead:adaptive,paused,off
testgpu() {
  if [ "$(left)" -gt 10 ]; then
    mkdir -p $T/models && tar xJf $D/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
    PD_MODELS_DIR=$T/models timeout $(lim 30) $T/test_gpu_spec > "$OUT/test_gpu_spec.txt" 2>&1
    echo "== test_gpu_spec rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "passed|FAIL" "$OUT/test_gpu_spec.txt" | tail -4
  else echo "== test_gpu_spec skipped: budget"; fi
}
# call 2 (lead's call 2, 16:45): nonpay free pay nonpayL freeL test nonpaymain payL (BUDGET 232)
# call 3 (lead's call 4, 17:12): nonpayT pay test nonpayLT freeLT (BUDGET 235)
# call 4: the same binary's knobs A/B: PD_SPEC_PROBE_SHARE=0.01 (the session-11 default, against the
# new 0.0025) and PD_SPEC_MIN_GAIN=0.08 (against 0.05)
# call 5 (optional, the lead's final check): the final code as a whole (request prior weight 2, probe
# share 0.0025): pay nonpayT test (~80 s)
PARTS=${PARTS:-pay nonpayT test}
for part in $PARTS; do
  case $part in
    nonpay) draft nonpay pdserve 0.1 48 1,8,32,64 3 40;;
    nonpayT) draft nonpayT pdserve 0.1 48 1,8,32,64 3 55 $DT;;
    payS1) (export PD_SPEC_PROBE_SHARE=0.01; draft payS1 pdserve 0.05 48 1,8,32,64 2 34);;
    nonpayTS1) (export PD_SPEC_PROBE_SHARE=0.01; draft nonpayTS1 pdserve 0.1 48 1,8,32,64 3 55 $DT);;
    nonpayLTS1) (export PD_SPEC_PROBE_SHARE=0.01; draft nonpayLTS1 pdserve 0.1 ${L_TOK:-128} 1,8,32,64 2 85 $DT);;
    nonpayTG8) (export PD_SPEC_MIN_GAIN=0.08; draft nonpayTG8 pdserve 0.1 48 1,8,32,64 3 55 $DT);;
    payG8) (export PD_SPEC_MIN_GAIN=0.08; draft payG8 pdserve 0.05 48 1,8,32,64 2 34);;
    nonpayLTG8) (export PD_SPEC_MIN_GAIN=0.08; draft nonpayLTG8 pdserve 0.1 ${L_TOK:-128} 8,32 2 60 $DT);;
    nonpayLT) draft nonpayLT pdserve 0.1 ${L_TOK:-128} 1,8,32,64 2 85 $DT;;
    freeLT) free freeLT ${L_TOK:-128} 1,8,32,64 2 85 $FT;;
    pay) draft pay pdserve 0.05 48 1,8,32,64 2 34;;
    free) free free 48 1,8,32,64 2 34;;
    nonpaymain) draft nonpay_main pdserve.main 0.1 48 32,64 2 24;;
    nonpayL) draft nonpayL pdserve 0.1 ${L_TOK:-128} 1,8,32,64 2 60;;
    payL) draft payL pdserve 0.05 ${L_TOK:-128} 1,8,32,64 2 60;;
    freeL) free freeL ${L_TOK:-128} 1,8,32,64 2 60;;
    test) testgpu;;
  esac
done
echo "total $(( $(date +%s) - t0 )) s"
