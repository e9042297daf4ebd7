#!/bin/sh
# dec12 helper, session 12 (issue 17: single stream ctx 128 >= 190 tok/s; batch-64 step <= 7.2 ms).
# Run from the repo root of the lead's checkout: sh build/gpu-dec12/run.sh OUT_DIR. Staged in
# build/gpu-dec12/: bins.tar.xz (pdserve, op_bench, test_backend_ops, test_gpu_golden of COMMIT,
# stripped), this script, LIMIT. Libraries: /tmp/gpulib/lib (the lead's wrapper); models for
# test_gpu_golden: build/gpu-lead/models.tar.xz + the tracked models/kjv-llama-6m. Model for the
# benchmarks: the tracked 8B shape config bench/configs/llama-3-8b, dummy weights.
# Variants (one binary, env switches): O = PD_CUDA_ATTN_EARLY=0 PD_CUDA_ATTN_ROPE=0 (main's
# kernels), N = PD_CUDA_ATTN_ROPE=0 (decode attention loads the K/V rows a graph step does not
# write before its PDL wait), F = defaults (N + RoPE/KV write of batched decode inside the decode
# attention kernel), E = F + PD_CUDA_GRAPH_EARLY=1 (programmatic graph edges from the source's
# launch completion).
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-dec12}
T=/tmp/dec12
t0=$(date +%s)
BUDGET=${BUDGET:-$(( $(cat $D/LIMIT) - 8 ))}
mkdir -p $T && tar xJf $D/bins.tar.xz -C $T
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/tmp/gpulib/lib}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cat $D/COMMIT
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
say() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
M=bench/configs/llama-3-8b
be() {  # name limit env... -- args...
  n=$1; l=$2; shift 2
  [ "$(left)" -lt 20 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  env $envs timeout $(lim $l) $T/pdserve bench-engine --device cuda --model $M --load-format dummy "$@" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  say "$n rc=$?"
  grep -E "^decode|pipelined|copy|card" "$OUT/$n.txt" | sed -E 's/  datasheet.*//; s/ +/ /g' | cut -c1-150
}
# 1. the new kernel path against the old on the card (bitwise)
timeout $(lim 30) $T/test_backend_ops attention_decode_early > "$OUT/ops_early.txt" 2>&1; say "ops early rc=$?"
tail -3 "$OUT/ops_early.txt"
# 2. the captured graphs (B = 1 ctx bucket 256, B = 64 ctx bucket 512), and their timing
be dump 30 PD_CUDA_GRAPH_DUMP=1 -- --only decode --ctx 128 --batches 64
grep -E "^graph:" "$OUT/dump.err" | head -8
# 3. op_bench single on the model's footprint (32 weight sets) and on 2 (session 11's replica)
[ "$(left)" -gt 30 ] && { OPB_SINGLE_LAYERS=32 timeout $(lim 30) $T/op_bench copy single > "$OUT/single32.txt" 2>&1; say "single32 rc=$?"; grep -E "copy|single rule" "$OUT/single32.txt" | sed -E 's/ +/ /g' | cut -c1-200; }
# 4. A/B, alternated twice
A="--only decode --ctx 128,4096 --batches 1,8,32,64"
be O1 25 PD_CUDA_ATTN_EARLY=0 PD_CUDA_ATTN_ROPE=0 -- $A
be F1 25 PD_CUDA_ATTN_EARLY=1 -- $A
be E1 25 PD_CUDA_GRAPH_EARLY=1 -- $A
be N1 25 PD_CUDA_ATTN_ROPE=0 -- $A
be O2 25 PD_CUDA_ATTN_EARLY=0 PD_CUDA_ATTN_ROPE=0 -- $A
be F2 25 PD_CUDA_ATTN_EARLY=1 -- $A
be E2 25 PD_CUDA_GRAPH_EARLY=1 -- $A
# 5. op_bench single, 2 weight sets, with the graph dump
[ "$(left)" -gt 25 ] && { OPB_SINGLE_LAYERS=2 PD_CUDA_GRAPH_DUMP=1 timeout $(lim 25) $T/op_bench copy single > "$OUT/single2.txt" 2> "$OUT/single2.err"; say "single2 rc=$?"; grep -E "single rule" "$OUT/single2.txt" | sed -E 's/ +/ /g' | cut -c1-200; }
# 6. golden
if [ "$(left)" -gt 20 ] && [ -f build/gpu-lead/models.tar.xz ]; then
  mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
  PD_MODELS_DIR=$T/models timeout $(lim 40) $T/test_gpu_golden > "$OUT/golden.txt" 2>&1; say "golden rc=$?"
  grep -E "passed|FAIL|graphs vs eager" "$OUT/golden.txt" | tail -5
fi
say done
