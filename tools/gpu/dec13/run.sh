#!/bin/sh
# dec13 helper, session 13 (issue 17: single stream ctx 128 >= 190 tok/s; batch-64 step <= 7.2 ms).
# Run from the repo root of the lead's checkout: sh build/gpu-dec13/run.sh OUT_DIR. Staged in
# build/gpu-dec13/: bins.tar.xz (pdserve, op_bench, test_backend_ops, test_gpu_golden, test_gpu_spec
# of COMMIT, stripped; pdserve_main, op_bench_main: the lead's build of main, the baseline), this
# script, LIMIT. Libraries: /tmp/gpulib/lib (the lead's wrapper). Model for the benchmarks: the
# tracked 8B shape config bench/configs/llama-3-8b, dummy weights; models for test_gpu_golden from
# build/gpu-lead/models.tar.xz + the tracked models/kjv-llama-6m.
# Round 2: M = 1 kernel boundaries. The skinny kernel's persistent build (PD_CUDA_SKINNY_PERSIST=4/5
# blocks per SM looping over the tiles, the next tile's loads in flight while this one is summed)
# and PD_CUDA_SKINNY_PREWAIT=2/0 (half / none of a first tile's loads before the PDL wait, the rest
# right after it) against the defaults and main's binary: op_bench single per GEMM kind, bench-engine
# single stream. Batched decode: the residual adds folded into the o / down GEMMs of decode steps
# (the branch's default; PD_MODEL_RESID_DECODE=0 off) alternated with off, batch 1-256. Goldens.
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
# 1. op_bench single (32 weight sets, the short list): main's binary, then the branch with variants
ob singleM 20 op_bench_main OPB_SINGLE_LAYERS=32 -- copy single
ob singleB 40 op_bench OPB_SINGLE_LAYERS=32 OPB_SINGLE_SHORT=1 \
  OPB_SINGLE_VARIANTS=PD_CUDA_SKINNY_PERSIST=4,PD_CUDA_SKINNY_PERSIST=5,PD_CUDA_SKINNY_PREWAIT=2,PD_CUDA_SKINNY_PREWAIT=0 -- copy single
# 2. bench-engine single stream: main, branch defaults, persistent 4 / 5, prewait 2; twice
S="--only single --ctx 128,4096"
for r in 1 2; do
  BIN=pdserve_main; be sM$r 14 -- $S; BIN=pdserve
  be sO$r 14 -- $S
  be sP4_$r 14 PD_CUDA_SKINNY_PERSIST=4 -- $S
  be sP5_$r 14 PD_CUDA_SKINNY_PERSIST=5 -- $S
  be sW2_$r 14 PD_CUDA_SKINNY_PREWAIT=2 -- $S
done
# 3. batched decode: rg in decode steps (branch default) vs off, and main's binary
A="--only decode --ctx 128 --batches 1,8,32,64,128,256"
for r in 1 2 3; do
  be R0_$r 16 PD_MODEL_RESID_DECODE=0 -- $A
  be RD$r 16 -- $A
done
BIN=pdserve_main; be M1 16 -- $A; BIN=pdserve
# 4. exactness: goldens on the branch's defaults and the new builds; op tests of the new builds
if [ "$(left)" -gt 15 ] && [ -f build/gpu-lead/models.tar.xz ]; then
  mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
  for v in "X=0" "PD_CUDA_SKINNY_PERSIST=4" "PD_CUDA_SKINNY_PREWAIT=2"; do
    [ "$(left)" -lt 12 ] && break
    env $v PD_MODELS_DIR=$T/models timeout $(lim 25) $T/test_gpu_golden > "$OUT/golden_$v.txt" 2>&1; say "golden $v rc=$?"
    grep -E "passed|FAIL|graphs vs eager" "$OUT/golden_$v.txt" | tail -3
  done
  [ "$(left)" -gt 20 ] && { PD_MODELS_DIR=$T/models timeout $(lim 40) $T/test_gpu_spec > "$OUT/spec.txt" 2>&1; say "spec rc=$?"; grep -E "passed|FAIL" "$OUT/spec.txt" | tail -3; }
fi
for v in "PD_CUDA_SKINNY_PERSIST=4 fused_rope" "PD_CUDA_SKINNY_PERSIST=4 matmul_fused" "PD_CUDA_SKINNY_PREWAIT=2 matmul_fused"; do
  [ "$(left)" -lt 20 ] && break
  set -- $v
  env $1 timeout $(lim 20) $T/test_backend_ops $2 > "$OUT/ops_$1_$2.txt" 2>&1; say "ops $1 $2 rc=$?"
  grep -E "^(ok|FAIL|not ok)|passed|failed" "$OUT/ops_$1_$2.txt" | head -4
done
say done
