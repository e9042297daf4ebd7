#!/bin/sh
# spec helper, session 6 (call 1 of tools/gpu/NOTES.md "Session 6, spec helper"): GPU tests (decode + verify graphs), verify/draft step times.
set -u
out=$1; mkdir -p "$out"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd ./pdserve | grep 'not found'
[ -e models/kjv-llama-6m ] || ln -s ../../../models/kjv-llama-6m models/kjv-llama-6m  # the tracked copy
ls models/kjv-llama-6m/ >/dev/null || exit 1
export PD_MODELS_DIR=models
t0=$(date +%s)
./test_gpu_spec > "$out/gpu_spec.log" 2>&1; echo "test_gpu_spec rc=$? ($(( $(date +%s) - t0 )) s)"; grep -vE "^\s*$" "$out/gpu_spec.log" | grep -v "^pdserve info" | tail -25 | cut -c1-220
./test_gpu_golden > "$out/golden.log" 2>&1; echo "test_gpu_golden rc=$?: $(tail -1 "$out/golden.log")"; grep -E "FAIL|graphs" "$out/golden.log" | head -8
B="--model bench/configs/llama-3-8b --load-format dummy"
./pdserve bench-engine $B --only verify --verify-tokens 8 --draft-model bench/configs/llama-3-8b-draft > "$out/verify.txt" 2>&1; echo "verify (graphs) rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "^(model|draft|verify|draft step)|acceptance 0.7" "$out/verify.txt" | cut -c1-150
grep -E "acceptance" "$out/verify.txt" | grep -v "0.7" | cut -c1-150
PD_CUDA_GRAPHS=0 ./pdserve bench-engine $B --only verify --verify-tokens 8 > "$out/verify_eager.txt" 2>&1; echo "verify (eager) rc=$?"
grep -E "^verify" "$out/verify_eager.txt" | cut -c1-110
./pdserve bench-engine --model bench/configs/llama-3-8b-draft --load-format dummy --only prefill > "$out/draft_prefill.txt" 2>&1; echo "draft prefill rc=$?"
grep -E "prefill" "$out/draft_prefill.txt" | cut -c1-120
./pdserve bench-engine $B --only prefill > "$out/target_prefill.txt" 2>&1; echo "target prefill rc=$?"
grep -E "prefill" "$out/target_prefill.txt" | cut -c1-120
echo "total $(( $(date +%s) - t0 )) s"
