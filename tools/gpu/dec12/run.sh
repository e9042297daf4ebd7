#!/bin/sh
# dec12 helper, session 12 (issue 17: single stream ctx 128 >= 190 tok/s; batch-64 step <= 7.2 ms).
# Run from the repo root of the lead's checkout: sh build/gpu-dec12/run.sh OUT_DIR. Staged in
# build/gpu-dec12/: bins.tar.xz (pdserve, op_bench, test_backend_ops, test_gpu_golden of COMMIT,
# stripped), this script, LIMIT. Libraries: /tmp/gpulib/lib (the lead's wrapper); models for
# test_gpu_golden: build/gpu-lead/models.tar.xz + the tracked models/kjv-llama-6m. Model for the
# benchmarks: the tracked 8B shape config bench/configs/llama-3-8b, dummy weights.
# Round 3 (the branch's final kernels): O = PD_CUDA_ATTN_EARLY=0 (main's decode attention), N =
# defaults (graph steps' decode attention loads the K/V rows the step does not write before its PDL
# wait); TR = N + PD_CUDA_GEMM_TUNE_ROTATE=1 (cuBLASLt decode candidates timed back to back on
# rotated weight copies, not after a 192 MB memset); host: bench-engine single pinned to one core
# (taskset) against unpinned (the forward call's host time was 5-10 or 30-55 us in call 3).
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-dec12}
T=/tmp/dec12
t0=$(date +%s)
BUDGET=${BUDGET:-$(( $(cat $D/LIMIT) - 8 ))}
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
  [ "$(left)" -lt 12 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  env $envs timeout $(lim $l) $PRE $T/pdserve bench-engine --device cuda --model $M --load-format dummy "$@" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  say "$n rc=$?"
  grep -E "^decode|pipelined" "$OUT/$n.txt" | sed -E 's/  datasheet.*//; s/ +/ /g; s/floor.*= //; s/back to back, one sync: //' | cut -c1-150
}
PRE=""
# 0. the host: CPUs, NUMA, the GPU's local CPUs
( nvidia-smi topo -m; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|NUMA|Model name"; B=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//');
  for f in /sys/bus/pci/devices/*$B/local_cpulist /sys/bus/pci/devices/*$B/numa_node; do echo "$f: $(cat $f 2>/dev/null)"; done ) > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt" | tail -12
# 1. kernels on the card
timeout $(lim 20) $T/test_backend_ops decode_early > "$OUT/ops_early.txt" 2>&1; say "ops decode_early rc=$?"; tail -1 "$OUT/ops_early.txt"
# 2. op_bench single (32 weight sets): device time, and the host's upload / launch calls
[ "$(left)" -gt 20 ] && { OPB_SINGLE_LAYERS=32 timeout $(lim 20) $T/op_bench copy single > "$OUT/single32.txt" 2>&1; say "single32 rc=$?"; grep -E "^single" "$OUT/single32.txt" | sed -E 's/ +/ /g; s/single rule //; s/floor.*%//' | cut -c1-230; }
# 3. host: single stream unpinned vs pinned to one core
S="--only single --ctx 128,128,128"
for r in 1 2; do
  PRE="";                be hU$r 12 -- $S
  PRE="taskset -c 0";    be h0_$r 12 -- $S
  PRE="taskset -c 7";    be h7_$r 12 -- $S
  PRE="taskset -c 15";   be h15_$r 12 -- $S
done
PRE=""
# 4. cuBLASLt tuning on rotated weights vs after a flush (batched decode), with the picks logged
be dumpR 15 PD_CUDA_GEMM_TUNE_ROTATE=1 PD_CUDA_GRAPH_DUMP=1 PDSERVE_LOG=debug -- --only decode --ctx 128 --batches 64
grep -E "cuBLASLt" "$OUT/dumpR.err" | head -12; grep -E "nvjet|type 2" "$OUT/dumpR.err" | head -6 | cut -c1-120
be dumpT 15 PDSERVE_LOG=debug -- --only decode --ctx 128 --batches 64
grep -E "cuBLASLt" "$OUT/dumpT.err" | head -12
T3="--only decode --ctx 128 --batches 32,64,128"
for r in 1 2 3; do
  be T$r 15 -- $T3
  be TR$r 15 PD_CUDA_GEMM_TUNE_ROTATE=1 -- $T3
done
# 5. the branch's final state against main's attention, every batch and context, alternated
A="--only decode --ctx 128,4096,8192,32768 --batches 1,8,32,64,128,256"
for r in 1 2 3; do
  be O$r 20 PD_CUDA_ATTN_EARLY=0 -- $A
  be N$r 20 -- $A
done
# 6. golden
if [ "$(left)" -gt 15 ] && [ -f build/gpu-lead/models.tar.xz ]; then
  mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
  PD_MODELS_DIR=$T/models timeout $(lim 40) $T/test_gpu_golden > "$OUT/golden.txt" 2>&1; say "golden rc=$?"
  grep -E "passed|FAIL|graphs vs eager" "$OUT/golden.txt" | tail -5
fi
say done
