#!/bin/sh
# Skinny GEMM (issue 17 item 1) in one device call: correctness (test_backend_ops skinny + matmul,
# optionally all of it and test_gpu_golden), op_bench gemv (cuBLASLt vs the row-streaming kernel,
# % of the copy rate of the same run; PD_CUDA_SKINNY_ROWS=2 too), then single-stream bench-engine
# on the Llama-3-8B shape with PD_CUDA_SKINNY=0 / 1 (same binary, alternated, REPS times).
# Run from the repo root with the folder G (default build/gpu-gemv) holding pdserve, op_bench,
# test_backend_ops, test_gpu_golden, models/ and lib/: sh G/run_gemv.sh OUT_DIR [full] [rows2]
set -u
out=$1
shift
G=${G:-build/gpu-gemv}
REPS=${REPS:-1}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/$G/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PD_MODELS_DIR=$G/models
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
has() { for a in $ARGS; do [ "$a" = "$1" ] && return 0; done; return 1; }
ARGS="$*"
t0=$(date +%s)
if has full; then
  timeout 100 $G/test_backend_ops > "$out/ops.log" 2>&1; echo "test_backend_ops (all) rc=$? ($(( $(date +%s) - t0 )) s)"
  timeout 60 $G/test_gpu_golden > "$out/golden.log" 2>&1; echo "test_gpu_golden rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -hE "FAIL|fail|passed|skipped" "$out/ops.log" "$out/golden.log" | head -20
else
  for t in cuda_skinny cuda_matmul; do
    timeout 40 $G/test_backend_ops $t > "$out/ops_$t.log" 2>&1; echo "test_backend_ops $t rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "FAIL|fail|passed" "$out/ops_$t.log" | head -8
  done
fi
timeout 40 $G/op_bench gemv > "$out/gemv.txt" 2>&1; echo "op_bench gemv rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "^copy|^gemv" "$out/gemv.txt" | cut -c6-
if has rows2; then
  PD_CUDA_SKINNY_ROWS=2 timeout 30 $G/op_bench gemv > "$out/gemv_rows2.txt" 2>&1; echo "rows=2 rc=$?"
  grep -E "^gemv" "$out/gemv_rows2.txt" | sed -E 's/cublasLt.*skinny/skinny/' | cut -c6-
fi
B="--model bench/configs/llama-3-8b --load-format dummy --only single --ctx 128,4096"
i=0
while [ $i -lt "$REPS" ]; do
  for s in 0 1; do
    PD_CUDA_SKINNY=$s timeout ${ENG_T:-60} $G/pdserve bench-engine $B > "$out/eng_s${s}_$i.txt" 2>&1
    echo "bench-engine SKINNY=$s run $i rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "^device|^decode|error" "$out/eng_s${s}_$i.txt" | cut -c1-170
  done
  i=$((i + 1))
done
