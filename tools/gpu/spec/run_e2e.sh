#!/bin/sh
# spec helper, session 6 (calls 2-3; calls 4-6 used --modes off,adaptive,off and subsets): end-to-end speedups (bench-spec), kjv pair + 8B-shaped dummy.
set -u
out=$1; mkdir -p "$out"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name --format=csv,noheader
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -e models/kjv-llama-6m ] || ln -s ../../../models/kjv-llama-6m models/kjv-llama-6m
export PD_MODELS_DIR=models
t0=$(date +%s)
if [ "${2:-}" = tests ]; then
  ./test_gpu_spec > "$out/tests.log" 2>&1; echo "test_gpu_spec rc=$?: $(tail -1 $out/tests.log)"
  ./test_gpu_golden >> "$out/tests.log" 2>&1; echo "test_gpu_golden rc=$?: $(tail -1 $out/tests.log)"
fi
G=models/golden/kjv-llama-6m.json
run() {  # name, args...
  n=$1; shift
  ./pdserve bench-spec --device cuda --batches 1,8,32,64 --reps 3 "$@" > "$out/$n.txt" 2> "$out/cur.err"; rc=$?; cat "$out/cur.err" >> "$out/err.log"
  echo "== $n rc=$rc ($(( $(date +%s) - t0 )) s)"
  grep -E "graphs in|ready in" "$out/cur.err" "$out/$n.txt" | sed 's/.*info: //' | cut -c1-120 | sort | uniq -c | head -6
  grep -E "batch=" "$out/$n.txt" | cut -c1-170
}
run kjv_draft --model models/kjv-llama-6m --speculative-method draft --speculative-model models/kjv-llama-1m \
  --golden $G --golden-key speculative_acceptance --max-tokens 128
run kjv_ngram --model models/kjv-llama-6m --speculative-method ngram --golden $G --repeat 4 --max-tokens 128
run kjv_lookahead --model models/kjv-llama-6m --speculative-method lookahead --golden $G --repeat 4 --max-tokens 128
run l8b_draft --model models/l8b --load-format dummy --speculative-method draft --speculative-model models/l8b-draft \
  --random-prompt 64 --max-tokens 128
run l8b_ngram --model models/l8b --load-format dummy --speculative-method ngram --random-prompt 32 --repeat 8 --max-tokens 128
run l8b_lookahead --model models/l8b --load-format dummy --speculative-method lookahead --random-prompt 32 --repeat 8 --max-tokens 128
rm -f "$out/cur.err"
echo "total $(( $(date +%s) - t0 )) s"
