#!/bin/sh
# Sampler A/B in one device call (issue 17 item 1): op_bench sample of main's sampler (op_bench_old:
# tools/gpu/op_bench.c linked with main's sample.cu.o) / this tree / this tree with the radix passes
# only (PD_CUDA_SAMPLE_FAST=0) / this tree with top-p-alone rows on the radix passes
# (PD_CUDA_SAMPLE_TOPP_MIN_CL=32), one table of us per call; then test_backend_ops (all of it,
# test_cuda_sample included). Run from a folder holding op_bench, op_bench_old, test_backend_ops
# and lib/ (the libraries the device image lacks): sh run_sampler_ab.sh OUT_DIR
set -u
out=$1
cd "$(dirname "$0")"
[ -d lib ] && export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
for b in old new fast0 toppradix; do
  case $b in
    old) set -- ./op_bench_old sample ;;
    new) set -- ./op_bench sample ;;
    fast0) set -- env PD_CUDA_SAMPLE_FAST=0 ./op_bench sample ;;
    toppradix) set -- env PD_CUDA_SAMPLE_TOPP_MIN_CL=32 ./op_bench sample ;;
  esac
  t0=$(date +%s); timeout 40 "$@" > "$out/sample_$b.txt" 2>&1; echo "$b rc=$? ($(( $(date +%s) - t0 )) s)"
done
echo "config | old | new | fast0 | toppradix (us/call)"
for b in old new fast0 toppradix; do
  grep "^sample" "$out/sample_$b.txt" | sed -E 's/ +us\/call.*//; s/.* ([0-9.]+)$/\1/' > "/tmp/col_$b"
done
grep "^sample" "$out/sample_new.txt" | sed -E 's/^sample (V=[0-9]+) +(B=[0-9]+) +(.*[^ ]) +[0-9.]+ us\/call.*/\1 \2 \3/' > /tmp/col_name
paste -d '|' /tmp/col_name /tmp/col_old /tmp/col_new /tmp/col_fast0 /tmp/col_toppradix
t0=$(date +%s)
timeout 95 ./test_backend_ops > "$out/test.log" 2>&1; echo "test_backend_ops rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "FAIL|fail|passed|checks|^ok|^not ok|pd_op_sample|^    " "$out/test.log" | head -40
