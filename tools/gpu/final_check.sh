#!/bin/sh
# One device call over the merged tree: the GPU test tiers, then the figures the other issues need
# from one GPU (speculative verify steps, the one-GPU KV handoff). Run from a folder holding
# pdserve, test_backend_ops, test_gpu_golden, lib/ (shared libraries the device image lacks),
# models/ (golden + small models) and bench/ (the bench configs).
# usage: sh final_check.sh OUT_DIR
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
[ -d lib ] && export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd ./pdserve | grep 'not found'
export PD_MODELS_DIR=models
B="--model bench/configs/llama-3-8b --load-format dummy"
./test_backend_ops > "$out/ops.log" 2>&1; echo "test_backend_ops rc=$?: $(tail -1 "$out/ops.log")"
grep -E "FAIL" "$out/ops.log" | head -5
./test_gpu_golden > "$out/golden.log" 2>&1; echo "test_gpu_golden rc=$?: $(tail -1 "$out/golden.log")"
grep -E "FAIL" "$out/golden.log" | head -5
# speculative decoding: verify steps of 1..8 tokens per sequence at batch 1/8/32/64
./pdserve bench-engine $B --only verify --verify-tokens 8 > "$out/verify.txt" 2>&1; echo "verify rc=$?"
grep -vE "^\s*$" "$out/verify.txt" | tail -40 | cut -c1-160
# the KV handoff on one GPU (prefill and decode processes on device 0, cuda-ipc): layer-wise
# overlap on and off
for ov in 1 0; do
  PD_KV_OVERLAP=$ov ./pdserve bench-handoff $B --tokenizer models/kjv-llama-6m --tokens 512,2048,8192 \
    --ttft-tokens 8192 --devices 0,0 --transport cuda-ipc --reps 5 --kv-cache-gib 8 > "$out/handoff_ov$ov.txt" 2>&1
  echo "== handoff overlap=$ov rc=$?"; grep -vE "^\s*$" "$out/handoff_ov$ov.txt" | tail -14 | cut -c1-160
done
