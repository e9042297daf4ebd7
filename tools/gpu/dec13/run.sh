#!/bin/sh
# dec13 helper, session 13 (issue 17: single stream ctx 128 >= 190 tok/s; batch-64 step <= 7.2 ms).
# Run from the repo root of the lead's checkout: sh build/gpu-dec13/run.sh OUT_DIR. Staged in
# build/gpu-dec13/: bins.tar.xz (pdserve, op_bench, test_backend_ops, test_gpu_golden, test_gpu_spec
# of COMMIT, stripped; pdserve_main, op_bench_main: the lead's build of main, the baseline), this
# script, LIMIT. Libraries: /tmp/gpulib/lib (the lead's wrapper). Model for the benchmarks: the
# tracked 8B shape config bench/configs/llama-3-8b, dummy weights; models for test_gpu_golden from
# build/gpu-lead/models.tar.xz + the tracked models/kjv-llama-6m.
# Round 3 (the branch's final state against main's binary, alternated): op_bench single; bench-engine
# single stream ctx 128-32768 and decode batch 1-256 (M = main, B = branch, B0 = branch with
# PD_MODEL_RESID_DECODE=0); test_gpu_golden, test_gpu_spec, test_backend_ops of the skinny kernel.
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-dec13}
T=/tmp/dec13
t0=$(date +%s)
BUDGET=${BUDGET:-$(( $(cat $D/LIMIT) - 6 ))}
mkdir -p $T && xz -dc $D/bins.tar.xz | tar xf - -C $T
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/tmp/gpulib/lib}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,pci.bus_id --format=csv,noheader
cat $D/COMMIT
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
say() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
M=bench/configs/llama-3-8b
BIN=pdserve
be() {  # name limit env... -- args...
  n=$1; l=$2; shift 2
  [ "$(left)" -lt 10 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  env $envs timeout $(lim $l) $T/$BIN bench-engine --device cuda --model $M --load-format dummy "$@" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  say "$n rc=$?"
  grep -E "^decode|pipelined" "$OUT/$n.txt" | sed -E 's/  datasheet.*//; s/ +/ /g; s/floor.*= //; s/back to back, one sync: //; s/decode //' | cut -c1-110
}
ob() {  # name limit binary env... -- args...
  n=$1; l=$2; b=$3; shift 3
  [ "$(left)" -lt 10 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  env $envs timeout $(lim $l) $T/$b "$@" > "$OUT/$n.txt" 2>&1
  say "$n rc=$?"
  grep -E "^single|^copy" "$OUT/$n.txt" | sed -E 's/ +/ /g; s/single //; s/host:.*//; s/b2b\+upload.*serial\+upload/ser+up/; s/floor.*GB\/s: //' | cut -c1-120
}
# 1. op_bench single (32 weight sets): main's binary, then the branch (short list) and PREWAIT=2
ob singleM 20 op_bench_main OPB_SINGLE_LAYERS=32 -- copy single
ob singleB 25 op_bench OPB_SINGLE_LAYERS=32 OPB_SINGLE_SHORT=1 OPB_SINGLE_VARIANTS=PD_CUDA_SKINNY_PREWAIT=2 -- copy single
# 2. bench-engine single stream, main vs branch, three times
S="--only single --ctx 128,4096,8192,32768"
for r in 1 2 3; do
  BIN=pdserve_main; be sM$r 15 -- $S; BIN=pdserve
  be sB$r 15 -- $S
done
# 3. batched decode: main, branch, branch without the decode residual fold; twice
A="--only decode --ctx 128 --batches 1,8,32,64,128,256"
for r in 1 2; do
  BIN=pdserve_main; be M$r 16 -- $A; BIN=pdserve
  be B$r 16 -- $A
  be B0_$r 16 PD_MODEL_RESID_DECODE=0 -- $A
done
# 4. exactness: goldens and the skinny kernel's op tests on the branch's defaults
if [ "$(left)" -gt 15 ] && [ -f build/gpu-lead/models.tar.xz ]; then
  mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
  PD_MODELS_DIR=$T/models timeout $(lim 25) $T/test_gpu_golden > "$OUT/golden.txt" 2>&1; say "golden rc=$?"
  grep -E "passed|FAIL|graphs vs eager" "$OUT/golden.txt" | tail -3
  PD_MODELS_DIR=$T/models timeout $(lim 30) $T/test_gpu_spec > "$OUT/spec.txt" 2>&1; say "spec rc=$?"; grep -E "passed|FAIL" "$OUT/spec.txt" | tail -3
fi
for t in hf_rounding matmul_fused fused_rope test_cuda_skinny; do
  [ "$(left)" -lt 12 ] && break
  timeout $(lim 30) $T/test_backend_ops $t > "$OUT/ops_$t.txt" 2>&1; say "ops $t rc=$?"
  grep -E "^(ok|FAIL|not ok)|passed|failed" "$OUT/ops_$t.txt" | head -4
done
say done
