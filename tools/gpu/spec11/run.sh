#!/bin/sh
# spec11 helper, session 11 (issue 15). Run from the repo root of the lead's checkout:
# sh build/gpu-spec11/run.sh OUT_DIR (LIMIT in build/gpu-spec11/LIMIT). Staged in build/gpu-spec11/:
# bins.tar.xz (pdserve = this branch, pdserve.main = main's, test_gpu_spec; stripped), models.tar.xz
# (kjv-llama-1m, golden; kjv-llama-6m is the tracked models/); the libs are
# the lead's /tmp/gpulib/lib; the model is build/gpu-lead/llama-3-8b (read-only).
# Parts (env PARTS, in this order; BUDGET s):
#   copy     ngram / lookahead single stream on the 8B shape, copy workload (--copy-chain 0.7: prompt lookup
#            proposes a copy of the output with 70% of its tokens kept; Markov target --dummy-residual-scale 0:0)
#   copy2    the same at fidelity 0.6 and 0.8 (a sweep crossing 0.7)
#   nonpay   adaptive vs off at batch 32/64 at EPS 0.1 (acceptance ~0.2)
#   batch    adaptive vs off at batch 1/8/32/64 on the draft fixture at a non-paying acceptance
#            (EPS 0.05), --modes off,adaptive,off,adaptive, new binary (BIN) then main's (OLD)
#   ngram    ngram / lookahead single stream on the 8B shape, --serial 4, EPS sweep (NG_EPS)
#   test     test_gpu_spec (greedy byte-identical with speculation on the card)
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-spec11}
T=/tmp/spec11bin
t0=$(date +%s)
mkdir -p $T && tar xJf $D/bins.tar.xz -C $T
export LD_LIBRARY_PATH=/tmp/gpulib/lib PD_SPEC_STATS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cat $D/COMMIT
left() { echo $(( ${BUDGET:-97} - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
M=${M:-build/gpu-lead/llama-3-8b}
W="--random-prompt 32 --random-prompts 8"
spec() {  # name binary limit args...
  n=$1; b=$2; l=$3; shift 3
  [ "$(left)" -lt 12 ] && { echo "== $n skipped: budget"; return; }
  timeout $(lim $l) $T/$b bench-spec --device ${DEV:-cuda} --model $M --load-format dummy "$@" --json "$OUT/$n.json" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  echo "== $n rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "ready in|batch=|summary" "$OUT/$n.txt" | sed 's/ (the others.*//; s/ready in/ready/' | cut -c1-230
  grep -E "spec stats: [0-9]+ steps|timed at warm-up|draft forwards: [0-9]|catch-up padding" "$OUT/$n.err" | sed 's/.*spec stats: //; s/.*engine: //' | cut -c1-200 | head -12
}
batch() {  # name binary
  spec $1 $2 38 --speculative-method draft --speculative-model $M --speculative-dummy-layers 1 --dummy-residual-scale 1:${B_EPS:-0.05} \
    $W --num-speculative-tokens 4 --max-tokens ${B_TOK:-48} --batches ${BATCHES:-1,8,32,64} --reps 2 --modes off,adaptive,off,adaptive
}
ngram() {  # eps
  spec ngram_$1 pdserve 16 --dummy-residual-scale 1:$1 $W --repeat 1 --num-speculative-tokens ${NG_K:-8} --max-tokens 96 \
    --batches 1 --serial 4 --reps 1 --modes off,ngram:fixed,ngram:adaptive,lookahead:adaptive
}
copy() {  # fidelity modes
  spec copy_$1 pdserve 20 --dummy-residual-scale 0:0 --copy-chain $1 --random-prompt 32 --random-prompts 4 --num-speculative-tokens 8 --max-tokens 96 \
    --batches 1 --serial 4 --reps 1 --modes $2
}
testgpu() {
  if [ "$(left)" -gt 8 ]; then
    mkdir -p $T/models && tar xJf $D/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
    PD_MODELS_DIR=$T/models timeout $(lim 25) $T/test_gpu_spec > "$OUT/test_gpu_spec.txt" 2>&1
    echo "== test_gpu_spec rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "passed|FAIL" "$OUT/test_gpu_spec.txt" | tail -4
  else echo "== test_gpu_spec skipped: budget"; fi
}
# call 1 (lead's call 2): batch ngram test; call 2 (lead's call 3): copy batch test copy2 nonpay;
# call 3 (LIMIT 100): nonpay nonpaymain batch test copy3
PARTS=${PARTS:-nonpay nonpaymain batch test copy3}
for part in $PARTS; do
  case $part in
    batch) batch batch_new pdserve;;
    main) batch batch_main pdserve.main;;
    ngram) for e in ${NG_EPS:-0 0.01 0.02}; do ngram $e; done;;
    copy) copy 0.7 off,ngram:fixed,ngram:adaptive,lookahead:adaptive;;
    copy2) for f in 0.6 0.8; do copy $f off,ngram:fixed,ngram:adaptive; done;;
    copy3) copy 0.7 off,ngram:fixed,ngram:adaptive;;
    nonpay) B_EPS=0.1 BATCHES=32,64 batch batch_nonpay pdserve;;
    nonpaymain) B_EPS=0.1 BATCHES=32,64 batch batch_nonpay_main pdserve.main;;
    test) testgpu;;
  esac
done
echo "total $(( $(date +%s) - t0 )) s"
