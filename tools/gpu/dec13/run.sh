#!/bin/sh
# dec13 helper, session 13 (issue 17: single stream ctx 128 >= 190 tok/s; batch-64 step <= 7.2 ms).
# Run from the repo root of the lead's checkout: sh build/gpu-dec13/run.sh OUT_DIR. Staged in
# build/gpu-dec13/: bins.tar.xz (pdserve, op_bench, test_backend_ops, test_gpu_golden of COMMIT,
# stripped), this script, LIMIT. Libraries: /tmp/gpulib/lib (the lead's wrapper). Model for the
# benchmarks: the tracked 8B shape config bench/configs/llama-3-8b, dummy weights.
# Round 1: the skinny kernel's TWO build (PD_CUDA_SKINNY_TWO=15: two tiles per block at M = 1, the
# second one's weights requested right after the PDL wait) on the card's op tests, op_bench single
# and bench-engine single stream against the defaults; diagnostics: op_bench single per GEMM kind
# (where the layer GEMMs lose to lm_head's rate) with the replica's N(0, 0.05) weights and the
# engine's N(0, 0.02); op_bench step M = 64 with each small kernel left out (the ceiling of folding
# it away); the B = 64 graph's memset nodes; bench-engine with PD_MODEL_RESID_GEMM=1 vs off.
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
# 0. kernels: the skinny kernel's TWO build (every form) against the CPU reference
for t in test_cuda_skinny matmul_fused fused_rope hf_rounding; do
  [ "$(left)" -lt 20 ] && break
  PD_CUDA_SKINNY_TWO=15 timeout $(lim 25) $T/test_backend_ops $t > "$OUT/ops_two_$t.txt" 2>&1; say "ops TWO=15 $t rc=$?"
  grep -E "^(ok|FAIL|not ok)|passed|failed" "$OUT/ops_two_$t.txt" | head -4
done
# 1. op_bench step at M = 64: each small kernel left out
ob step64 15 OPB_STEP_M=64 -- copy step
grep -E "^step|^copy" "$OUT/step64.txt" | sed -E 's/ +/ /g' | cut -c1-200
# 2. op_bench single, 32 weight sets, per GEMM kind; default vs PD_CUDA_SKINNY_TWO=15 (v1); weights
#    N(0, 0.05) then N(0, 0.02) (the engine's)
ob single05 40 OPB_SINGLE_LAYERS=32 OPB_SINGLE_VARIANTS=PD_CUDA_SKINNY_TWO=15 -- copy single
grep -E "^single|^copy" "$OUT/single05.txt" | sed -E 's/ +/ /g; s/single //; s/host:.*//; s/b2b\+upload.*serial\+upload/ser+up/' | cut -c1-200
# 3. bench-engine single stream: O (defaults) vs T (PD_CUDA_SKINNY_TWO=15), alternated
S="--only single --ctx 128,4096"
for r in 1 2; do
  be sO$r 14 -- $S
  be sT$r 14 PD_CUDA_SKINNY_TWO=15 -- $S
done
ob single02 20 OPB_SINGLE_LAYERS=32 OPB_W_STD=0.02 -- copy single
grep -E "^single|^copy" "$OUT/single02.txt" | sed -E 's/ +/ /g; s/single //; s/host:.*//; s/b2b\+upload.*serial\+upload/ser+up/' | cut -c1-200
# 4. the B = 64 graph: memset nodes (size, address) and the cuBLASLt picks
be dump64 15 PD_CUDA_GRAPH_DUMP=1 PDSERVE_LOG=debug -- --only decode --ctx 128 --batches 64
grep -E "cuBLASLt" "$OUT/dump64.err" | head -12
grep -E "^graph: " "$OUT/dump64.err" | tail -3
grep -E "memset" "$OUT/dump64.err" | head -4
grep -E "graph node" "$OUT/dump64.err" | tail -12 | cut -c1-140
# 5. residual adds in the GEMMs (rg) vs the norms' adds, alternated
A="--only decode --ctx 128 --batches 8,32,64,128"
for r in 1 2; do
  be O$r 15 -- $A
  be RG$r 15 PD_MODEL_RESID_GEMM=1 -- $A
done
# 6. golden with the TWO build
if [ "$(left)" -gt 15 ] && [ -f build/gpu-lead/models.tar.xz ]; then
  mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
  PD_CUDA_SKINNY_TWO=15 PD_MODELS_DIR=$T/models timeout $(lim 40) $T/test_gpu_golden > "$OUT/golden_two.txt" 2>&1; say "golden TWO=15 rc=$?"
  grep -E "passed|FAIL|graphs vs eager" "$OUT/golden_two.txt" | tail -5
fi
say done
