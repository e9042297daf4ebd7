#!/bin/sh
# spec2 helper, session 6: "adaptive never slower than off" on kjv-llama-6m (ngram, lookahead;
# bench-spec with two plain and two adaptive engines per method, batches 1/8/32/64), test_gpu_spec,
# and the 8B shape's lookahead if time is left. Run from build/gpu-spec2/ of the lead's checkout
# (stripped pdserve and test_gpu_spec of `make CUDA=1 BUILD=build/gpu` in the spec2 worktree, lib/
# and models/ as build/gpu-spec/ has them; lib/ also needs liburing and libhiredis now). MODES:
# the bench-spec modes of the kjv runs; L8B=0: no 8B run. PD_SPEC_STATS=1: each engine logs its speculation
# counters and measured step shapes when it stops.
set -u
out=$1; mkdir -p "$out"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name --format=csv,noheader
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -e models/kjv-llama-6m ] || ln -s ../../../models/kjv-llama-6m models/kjv-llama-6m
export PD_MODELS_DIR=models PD_SPEC_STATS=1
t0=$(date +%s)
timeout 120 ./test_gpu_spec > "$out/tests.log" 2>&1; echo "test_gpu_spec rc=$? ($(( $(date +%s) - t0 )) s): $(tail -1 "$out/tests.log")"
G=models/golden/kjv-llama-6m.json
run() {  # name, args...
  n=$1; shift
  timeout 150 ./pdserve bench-spec --device cuda --batches 1,8,32,64 --reps 3 "$@" > "$out/$n.txt" 2> "$out/$n.err"; rc=$?
  echo "== $n rc=$rc ($(( $(date +%s) - t0 )) s)"
  grep -E "batch=" "$out/$n.txt" | cut -c1-170
  grep -E "spec stats: [0-9]+ steps" "$out/$n.err" | sed 's/.*spec stats: //' | cut -c1-330
}
run kjv_ngram --model models/kjv-llama-6m --speculative-method ngram --golden $G --repeat 4 --max-tokens 128 --modes ${MODES:-off,adaptive,off,adaptive}
run kjv_lookahead --model models/kjv-llama-6m --speculative-method lookahead --golden $G --repeat 4 --max-tokens 128 --modes ${MODES:-off,adaptive,off,adaptive}
if [ "${L8B:-1}" = 1 ] && [ $(( $(date +%s) - t0 )) -lt 70 ]; then
  run l8b_lookahead --model models/l8b --load-format dummy --speculative-method lookahead --random-prompt 32 --repeat 8 --max-tokens 64 --modes off,adaptive,off
fi
echo "total $(( $(date +%s) - t0 )) s"
