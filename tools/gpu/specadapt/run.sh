#!/bin/sh
# specadapt helper, session 7 (issue 15): interleaved bench-spec (engines side by side, rotated
# order each rep, median + spread, ratio to the plain engines' median and their noise band) on
# kjv-llama-6m (ngram, lookahead; "adaptive never slower than off"), and the Llama-3-8B shape with
# dummy weights on 8 random prompts (what acceptance prompt lookup / lookahead get on the cycles
# random-weight greedy decoding falls into; single-stream speedups). Run from build/gpu-specadapt/
# of the lead's checkout: stripped pdserve + test_gpu_spec, lib/ (= /work/devlibs/lib), models/
# (golden/kjv-llama-6m.json, kjv-llama-1m, l8b = bench/configs/llama-3-8b + the kjv tokenizer;
# kjv-llama-6m linked to the tracked copy at run time). Env: PARTS (tests kjv l8b), REPS, L8B_MODES,
# L8B_TOKENS, L8B_BATCHES, L8B_REPS, KJV_METHODS. Logs come back as all.tar.xz.
set -u
out=$1; mkdir -p "$out"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -e models/kjv-llama-6m ] || ln -s ../../../models/kjv-llama-6m models/kjv-llama-6m
export PD_MODELS_DIR=models PD_SPEC_STATS=1
t0=$(date +%s)
PARTS=${PARTS:-tests kjv l8b}
G=models/golden/kjv-llama-6m.json
run() {  # name, limit, args...
  n=$1; lim=$2; shift 2
  timeout "$lim" ./pdserve bench-spec --device cuda "$@" --json "$out/$n.json" > "$out/$n.txt" 2> "$out/$n.err"; rc=$?
  echo "== $n rc=$rc ($(( $(date +%s) - t0 )) s)"
  grep -E "ready in|batch=|summary|workload" "$out/$n.txt" | cut -c1-250
  grep -E "spec stats: [0-9]+ steps" "$out/$n.err" | sed 's/.*spec stats: //' | cut -c1-300
}
case " $PARTS " in *" tests "*)
  timeout 60 ./test_gpu_spec > "$out/tests.log" 2>&1; echo "test_gpu_spec rc=$? ($(( $(date +%s) - t0 )) s): $(tail -1 "$out/tests.log")";;
esac
case " $PARTS " in *" kjv "*)
  for m in ${KJV_METHODS:-ngram lookahead}; do
    run kjv_$m 40 --model models/kjv-llama-6m --speculative-method $m --golden $G --repeat 4 --max-tokens 128 \
      --batches 1,8,32,64 --reps ${REPS:-7} --modes off,adaptive,off,adaptive,off
  done;;
esac
case " $PARTS " in *" l8b "*)
  run l8b 100 --model models/l8b --load-format dummy --random-prompt 32 --random-prompts 8 --max-tokens ${L8B_TOKENS:-128} \
    --batches ${L8B_BATCHES:-1,8} --reps ${L8B_REPS:-3} --modes ${L8B_MODES:-off,ngram:adaptive,ngram:fixed,lookahead:adaptive};;
esac
[ -e "$out/tests.log" ] && echo "test_gpu_spec: $(tail -1 "$out/tests.log")"
(cd "$out" && tar cJf all.tar.xz --exclude all.tar.xz . && find . -type f ! -name all.tar.xz -delete)
echo "total $(( $(date +%s) - t0 )) s"
