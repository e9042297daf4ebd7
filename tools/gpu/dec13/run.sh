#!/bin/sh
# dec13 helper, session 13 (issue 17: single stream ctx 128 >= 190 tok/s; batch-64 step <= 7.2 ms).
# Run from the repo root of the lead's checkout: sh build/gpu-dec13/run.sh OUT_DIR. Staged in
# build/gpu-dec13/: bins.tar.xz (pdserve, op_bench, test_backend_ops, test_gpu_golden of COMMIT,
# stripped), this script, LIMIT. Libraries: /tmp/gpulib/lib (the lead's wrapper). Model for the
# benchmarks: the tracked 8B shape config bench/configs/llama-3-8b, dummy weights.
# Round 1 (diagnostics): op_bench single per GEMM kind (where the layer GEMMs lose to lm_head's
# rate) with the replica's N(0, 0.05) weights and the engine's N(0, 0.02); op_bench step M = 64
# with each small kernel left out (the ceiling of folding it away); the B = 64 graph's memset
# nodes; bench-engine with PD_MODEL_RESID_GEMM=1 (residual adds in the o / down GEMMs) vs off.
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-dec13}
T=/tmp/dec13
t0=$(date +%s)
BUDGET=${BUDGET:-$(( $(cat $D/LIMIT) - 6 ))}
mkdir -p $T && tar xJf $D/bins.tar.xz -C $T
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/tmp/gpulib/lib}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,pci.bus_id --format=csv,noheader
cat $D/COMMIT
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
say() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
M=bench/configs/llama-3-8b
be() {  # name limit env... -- args...
  n=$1; l=$2; shift 2
  [ "$(left)" -lt 10 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  env $envs timeout $(lim $l) $T/pdserve bench-engine --device cuda --model $M --load-format dummy "$@" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  say "$n rc=$?"
  grep -E "^decode|pipelined" "$OUT/$n.txt" | sed -E 's/  datasheet.*//; s/ +/ /g; s/floor.*= //; s/back to back, one sync: //' | cut -c1-150
}
ob() {  # name limit env... -- args...
  n=$1; l=$2; shift 2
  [ "$(left)" -lt 10 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  env $envs timeout $(lim $l) $T/op_bench "$@" > "$OUT/$n.txt" 2>&1
  say "$n rc=$?"
}
# 1. op_bench step at M = 64: each small kernel left out
ob step64 15 OPB_STEP_M=64 -- copy step
grep -E "^step|^copy" "$OUT/step64.txt" | sed -E 's/ +/ /g' | cut -c1-200
# 2. op_bench single, 32 weight sets, per GEMM kind; weights N(0, 0.05) then N(0, 0.02)
ob single05 25 OPB_SINGLE_LAYERS=32 -- copy single
grep -E "^single|^copy" "$OUT/single05.txt" | sed -E 's/ +/ /g; s/single rule //; s/host:.*//' | cut -c1-200
ob single02 25 OPB_SINGLE_LAYERS=32 OPB_W_STD=0.02 -- copy single
grep -E "^single|^copy" "$OUT/single02.txt" | sed -E 's/ +/ /g; s/single rule //; s/host:.*//' | cut -c1-200
# 3. the B = 64 graph: memset nodes (size, address) and the cuBLASLt picks
be dump64 15 PD_CUDA_GRAPH_DUMP=1 PDSERVE_LOG=debug -- --only decode --ctx 128 --batches 64
grep -E "cuBLASLt" "$OUT/dump64.err" | head -12
grep -E "^graph: " "$OUT/dump64.err" | tail -3
grep -E "memset" "$OUT/dump64.err" | head -4
grep -E "graph node" "$OUT/dump64.err" | tail -30 | cut -c1-140
# 4. residual adds in the GEMMs (rg) vs the norms' adds, alternated
A="--only decode --ctx 128 --batches 1,8,32,64,128"
for r in 1 2; do
  be O$r 16 -- $A
  be RG$r 16 PD_MODEL_RESID_GEMM=1 -- $A
done
say done
