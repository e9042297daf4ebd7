#!/bin/sh
# dec14 helper, session 14 (issue 17: single stream ctx 128 robustly >= 190 tok/s).
# Run from the repo root of the lead's checkout: sh build/gpu-dec14/run.sh OUT_DIR. Staged in
# build/gpu-dec14/ (tools/gpu/dec14/stage.sh): bins.tar.xz (pdserve, op_bench, test_backend_ops,
# test_gpu_golden, test_gpu_spec of COMMIT, stripped), this script, LIMIT. Libraries: /tmp/gpulib/lib
# (the lead's wrapper). Model: the tracked 8B shape config bench/configs/llama-3-8b, dummy weights;
# models for test_gpu_golden from build/gpu-lead/models.tar.xz + the tracked models/kjv-llama-6m.
# Round 3 (confirmation, <= 85 s): the final default (the fused norm's weight prefetched before the
# PDL wait, PD_CUDA_SKINNY_NORM_PF=1) against it off (=0), alternated; op_bench single with per-layer
# norm weights; goldens, spec and the fused forms' op test on the default.
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-dec14}
T=/tmp/dec14
t0=$(date +%s)
BUDGET=${BUDGET:-$(( $(cat $D/LIMIT) - 5 ))}
mkdir -p $T && xz -dc $D/bins.tar.xz | tar xf - -C $T
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/tmp/gpulib/lib}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,pci.bus_id --format=csv,noheader
cat $D/COMMIT
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
say() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
M=bench/configs/llama-3-8b
be() {  # name limit env... -- args...
  n=$1; l=$2; shift 2
  [ "$(left)" -lt 8 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  env $envs timeout $(lim $l) $T/pdserve bench-engine --device cuda --model $M --load-format dummy "$@" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  say "$n rc=$? [$envs]"
  grep -E "^decode|pipelined" "$OUT/$n.txt" | sed -E 's/  datasheet.*//; s/ +/ /g; s/floor.*= //; s/back to back, one sync: //; s/decode //' | cut -c1-110
}
OFF=PD_CUDA_SKINNY_NORM_PF=0
S="--only single --ctx 128,4096,8192,32768"
A="--only decode --ctx 128 --batches 1,8,32,64,128,256"
if [ -f build/gpu-lead/models.tar.xz ]; then
  mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
  PD_MODELS_DIR=$T/models timeout $(lim 15) $T/test_gpu_golden > "$OUT/golden.txt" 2>&1; say "golden rc=$?"
  grep -E "passed|FAIL|graphs vs eager" "$OUT/golden.txt" | tail -3
fi
for r in 1 2 3; do
  be sN$r 12 -- $S
  be sO$r 12 $OFF -- $S
done
be dN1 14 -- $A
be dO1 14 $OFF -- $A
be dN2 14 -- $A
OPB_SINGLE_LAYERS=32 OPB_SINGLE_SHORT=1 OPB_SINGLE_NORMS=1 OPB_SINGLE_VARIANTS=$OFF timeout $(lim 14) $T/op_bench copy single > "$OUT/single.txt" 2>&1
say "op_bench single (per-layer norms; v1 = $OFF) rc=$?"
grep -E "whole step|no attention" "$OUT/single.txt" | sed -E 's/ +/ /g; s/b2b\+upload.*//' | cut -c1-80
if [ -f build/gpu-lead/models.tar.xz ]; then
  PD_MODELS_DIR=$T/models timeout $(lim 20) $T/test_gpu_spec > "$OUT/spec.txt" 2>&1; say "spec rc=$?"
  grep -E "passed|FAIL" "$OUT/spec.txt" | tail -2
fi
timeout $(lim 20) $T/test_backend_ops test_cuda_matmul_fused > "$OUT/ops_matmul_fused.txt" 2>&1; say "ops matmul_fused rc=$?"
grep -E "^(ok|FAIL|not ok)|passed|failed" "$OUT/ops_matmul_fused.txt" | head -3
say done
