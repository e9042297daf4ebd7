#!/bin/sh
# Tensor-core skinny GEMM (issues 17 + 15) in one device call, from the repo root:
#   sh build/gpu-mma/run.sh OUT_DIR
# (the folder G = build/gpu-mma holds bins.tar.xz = op_bench, pdserve, test_backend_ops; lib/).
# 1. test_backend_ops cuda_skinny: both skinny kernels against the CPU reference, M = 1..16;
# 2. op_bench gemv: cuBLASLt / CUDA-core skinny / tensor-core skinny (16 and 32 rows per block) on
#    the Llama-3-8B shapes at M = 1..9, 12, 16, % of the copy rate measured in the same run;
# 3. bench-engine --only verify --verify-tokens 16 (batch 1: M = 1..16 through the whole model,
#    dummy Llama-3-8B weights) with PD_CUDA_SKINNY=0 (cuBLASLt), =1 + PD_CUDA_SKINNY_MMA=0 (the
#    CUDA-core kernel for M <= 8, cuBLASLt above), =1 + MMA=1 (tensor cores from M = 5), =1 + MMA=2
#    (tensor cores at every M). Same binary, env switches only.
set -u
G=${G:-build/gpu-mma}; out=$1; mkdir -p "$out"
(cd $G && tar xJf bins.tar.xz)
export LD_LIBRARY_PATH="$PWD/$G/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s]"; }
timeout 70 $G/test_backend_ops cuda_skinny > "$out/ops_cuda_skinny.log" 2>&1
echo "test_backend_ops cuda_skinny rc=$? $(el)"; grep -E "FAIL|passed" "$out/ops_cuda_skinny.log" | head -6
timeout 40 $G/op_bench gemv > "$out/gemv.txt" 2>&1; echo "op_bench gemv rc=$? $(el)"
grep -E "^copy|^gemv" "$out/gemv.txt" | sed -E 's/^gemv //; s/ us/us/g; s/  +/ /g' | cut -c1-240
B="--model bench/configs/llama-3-8b --load-format dummy --only verify --verify-tokens 16"
for v in 0:1 1:0 1:1 1:2; do
  s=${v%%:*}; m=${v#*:}
  [ $(( $(date +%s) - t0 )) -gt 190 ] && { echo "skipped SKINNY=$s MMA=$m (time)"; continue; }
  PD_CUDA_SKINNY=$s PD_CUDA_SKINNY_MMA=$m timeout 45 $G/pdserve bench-engine $B > "$out/verify_s${s}_m$m.txt" 2>&1
  echo "verify SKINNY=$s MMA=$m rc=$? $(el): batch 1, ms for tokens/seq 1..16:"
  grep -E "^verify step +batch=1 " "$out/verify_s${s}_m$m.txt" | awk '{printf " %s", $6} END {print ""}'
done
echo "total $(el)"
