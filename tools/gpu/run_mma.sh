#!/bin/sh
# Tensor-core skinny GEMM (issues 17 + 15), call 2 (<= 90 s), from the repo root:
#   sh build/gpu-mma/run.sh OUT_DIR
# (the folder G = build/gpu-mma holds bins.tar.xz = op_bench, pdserve, test_backend_ops; lib/).
# 1. test_backend_ops cuda_skinny_mma (M = 1..16, every variant, the measured rule) and cuda_skinny;
# 2. op_bench gemv: cuBLASLt / CUDA-core / tensor-core (16, 32 rows; single, double-buffered) /
#    "rule" (PD_CUDA_SKINNY=1) on the Llama-3-8B shapes at M = 1..9, 12, 16, % of the copy rate;
# 3. bench-engine --only verify --verify-tokens 9 (verify graphs: M = 1, 2, 3, 5, 9 at batch 1, the
#    buckets, M = 8 at batch 8 q = 1) with PD_CUDA_SKINNY=0 (cuBLASLt), =1 + MMA=0 (the CUDA-core
#    kernel to M = 8, session-8 rule), =1 (the measured rule). Same binary, env switches only.
set -u
G=${G:-build/gpu-mma}; out=$1; mkdir -p "$out"
(cd $G && tar xJf bins.tar.xz)
export LD_LIBRARY_PATH="$PWD/$G/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s]"; }
SB=; command -v stdbuf >/dev/null 2>&1 && SB="stdbuf -oL"  # line-buffered: a timeout keeps what ran
late() { [ $(( $(date +%s) - t0 )) -gt "$1" ]; }
timeout 35 $SB $G/test_backend_ops cuda_skinny_mma > "$out/ops_cuda_skinny_mma.log" 2>&1
echo "test_backend_ops cuda_skinny_mma rc=$? $(el)"; grep -E "FAIL|passed|ok " "$out/ops_cuda_skinny_mma.log" | head -6
timeout 15 $G/op_bench gemv > "$out/gemv.txt" 2>&1; echo "op_bench gemv rc=$? $(el)"
grep -E "^copy|^gemv" "$out/gemv.txt" | sed -E 's/^gemv //; s/ us/us/g; s/  +/ /g; s/ \(.*//' | cut -c1-240
B="--model bench/configs/llama-3-8b --load-format dummy --only verify --verify-tokens 9"
for v in 0:1 1:0 1:1; do
  s=${v%%:*}; m=${v#*:}
  late 62 && { echo "skipped SKINNY=$s MMA=$m (time)"; continue; }
  PD_CUDA_SKINNY=$s PD_CUDA_SKINNY_MMA=$m timeout 20 $G/pdserve bench-engine $B > "$out/verify_s${s}_m$m.txt" 2>&1
  echo "verify SKINNY=$s MMA=$m rc=$? $(el): ms at tokens/seq 1..9, batch 1 then batch 8:"
  for b in 1 8; do grep -E "^verify step +batch=$b " "$out/verify_s${s}_m$m.txt" | awk '{printf " %s", $6} END {print ""}'; done
done
if late 70; then echo "skipped cuda_skinny (time)"; else
  timeout 18 $SB $G/test_backend_ops cuda_skinny > "$out/ops_cuda_skinny.log" 2>&1
  echo "test_backend_ops cuda_skinny rc=$? $(el)"; grep -E "FAIL|passed" "$out/ops_cuda_skinny.log" | head -4
fi
echo "total $(el)"
