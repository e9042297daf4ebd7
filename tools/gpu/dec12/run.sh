#!/bin/sh
# dec12 helper, session 12 (issue 17: single stream ctx 128 >= 190 tok/s; batch-64 step <= 7.2 ms).
# Run from the repo root of the lead's checkout: sh build/gpu-dec12/run.sh OUT_DIR. Staged in
# build/gpu-dec12/: bins.tar.xz (pdserve, op_bench, test_backend_ops, test_gpu_golden of COMMIT,
# stripped), this script, LIMIT. Libraries: /tmp/gpulib/lib (the lead's wrapper); models for
# test_gpu_golden: build/gpu-lead/models.tar.xz + the tracked models/kjv-llama-6m. Model for the
# benchmarks: the tracked 8B shape config bench/configs/llama-3-8b, dummy weights.
# Variants (one binary, env switches): O = PD_CUDA_ATTN_EARLY=0 PD_CUDA_ATTN_ROPE=0 (main's
# kernels); N = PD_CUDA_ATTN_ROPE=0 (decode attention loads the K/V rows a graph step does not
# write before its PDL wait); F = defaults (N + RoPE/KV write of batched decode steps inside the
# decode attention kernel); NE, FE = N, F + PD_CUDA_GRAPH_EARLY=1 (programmatic graph edges from the
# source's launch completion); P6/P11/P16 = N + PD_CUDA_ATTN_PREFETCH_KB=6144/11264/16384 (a one-wave
# decode attention fetches that much of the o weight's tail into L2 while it runs). A nvidia-smi
# sampler (50 ms) runs throughout (smi.csv).
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-dec12}
T=/tmp/dec12
t0=$(date +%s)
BUDGET=${BUDGET:-$(( $(cat $D/LIMIT) - 8 ))}
mkdir -p $T && tar xJf $D/bins.tar.xz -C $T
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/tmp/gpulib/lib}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cat $D/COMMIT
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
say() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
F="timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
nvidia-smi --query-gpu=$F --format=csv -lms 50 > "$OUT/smi.csv" 2> "$OUT/smi.err" &
SMI=$!
sleep 1; kill -0 $SMI 2>/dev/null || { F="timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"; nvidia-smi --query-gpu=$F --format=csv -lms 50 > "$OUT/smi.csv" 2>> "$OUT/smi.err" & SMI=$!; }
M=bench/configs/llama-3-8b
be() {  # name limit env... -- args...
  n=$1; l=$2; shift 2
  [ "$(left)" -lt 15 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  echo "$(date +%T.%N | cut -c1-12) start $n" >> "$OUT/marks.txt"
  env $envs timeout $(lim $l) $T/pdserve bench-engine --device cuda --model $M --load-format dummy "$@" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  say "$n rc=$?"
  grep -E "^decode|pipelined" "$OUT/$n.txt" | sed -E 's/  datasheet.*//; s/ +/ /g; s/floor.*= //; s/back to back, one sync: //' | cut -c1-150
}
ob() {  # name limit env... (op_bench copy single)
  n=$1; l=$2; shift 2
  [ "$(left)" -lt 20 ] && { say "$n skipped: budget"; return; }
  echo "$(date +%T.%N | cut -c1-12) start $n" >> "$OUT/marks.txt"
  env "$@" timeout $(lim $l) $T/op_bench copy single > "$OUT/$n.txt" 2> "$OUT/$n.err"
  say "$n rc=$?"
  grep -E "^single" "$OUT/$n.txt" | sed -E 's/ +/ /g; s/single rule //; s/floor.*: //' | cut -c1-170
}
# 1. kernels on the card
timeout $(lim 60) $T/test_backend_ops attention_decode > "$OUT/ops_attn.txt" 2>&1; say "ops attention_decode rc=$?"
grep -E "^ok|FAIL|passed" "$OUT/ops_attn.txt" | tail -6
timeout $(lim 20) $T/test_backend_ops rope_kv > "$OUT/ops_rope.txt" 2>&1; say "ops rope_kv rc=$?"; tail -1 "$OUT/ops_rope.txt"
# 2. the captured graphs (B = 1 bucket 256, B = 64 bucket 512)
be dump 20 PD_CUDA_GRAPH_DUMP=1 -- --only decode --ctx 128 --batches 64
grep -E "^graph:" "$OUT/dump.err" | head -8
# 3. op_bench single: 2 weight sets (session 11's replica), 32 (the model's footprint), 32 after 300 ms of GEMMs
ob single2 25 OPB_SINGLE_LAYERS=2
ob single32 25 OPB_SINGLE_LAYERS=32
ob single32p 25 OPB_SINGLE_LAYERS=32 PD_CUDA_ATTN_PREFETCH_KB=11264
# 4. single stream right after bench-engine's GEMM peak, four times in a row
be warm 20 -- --only single --ctx 128,128,128,128,4096
# 5. the L2 prefetch during attention, single stream
S="--only single --ctx 128,4096,32768"
for r in 1 2; do
  be sN$r 15 PD_CUDA_ATTN_ROPE=0 -- $S
  be sP6$r 15 PD_CUDA_ATTN_ROPE=0 PD_CUDA_ATTN_PREFETCH_KB=6144 -- $S
  be sP11$r 15 PD_CUDA_ATTN_ROPE=0 PD_CUDA_ATTN_PREFETCH_KB=11264 -- $S
  be sP16$r 15 PD_CUDA_ATTN_ROPE=0 PD_CUDA_ATTN_PREFETCH_KB=16384 -- $S
done
# 6. A/B of the batched-decode changes, alternated (a third round after golden, if time is left)
A="--only decode --ctx 128,4096 --batches 1,8,32,64,128,256"
ab() {
  be O$1 20 PD_CUDA_ATTN_EARLY=0 PD_CUDA_ATTN_ROPE=0 -- $A
  be N$1 20 PD_CUDA_ATTN_ROPE=0 -- $A
  be NE$1 20 PD_CUDA_ATTN_ROPE=0 PD_CUDA_GRAPH_EARLY=1 -- $A
  be F$1 20 PD_CUDA_ATTN_EARLY=1 -- $A
  be FE$1 20 PD_CUDA_GRAPH_EARLY=1 -- $A
}
ab 1
ab 2
# 7. golden
if [ "$(left)" -gt 20 ] && [ -f build/gpu-lead/models.tar.xz ]; then
  mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
  PD_MODELS_DIR=$T/models timeout $(lim 40) $T/test_gpu_golden > "$OUT/golden.txt" 2>&1; say "golden rc=$?"
  grep -E "passed|FAIL|graphs vs eager" "$OUT/golden.txt" | tail -5
fi
ab 3
kill $SMI 2>/dev/null
say done
