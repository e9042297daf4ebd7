#!/bin/sh
# dec14 helper, session 14 (issue 17: single stream ctx 128 robustly >= 190 tok/s).
# Run from the repo root of the lead's checkout: sh build/gpu-dec14/run.sh OUT_DIR. Staged in
# build/gpu-dec14/ (tools/gpu/dec14/stage.sh): bins.tar.xz (pdserve, op_bench, test_backend_ops,
# test_gpu_golden, test_gpu_spec of COMMIT, stripped), this script, LIMIT. Libraries: /tmp/gpulib/lib
# (the lead's wrapper). Model: the tracked 8B shape config bench/configs/llama-3-8b, dummy weights;
# models for test_gpu_golden from build/gpu-lead/models.tar.xz + the tracked models/kjv-llama-6m.
# Round 1: the skinny kernel's L2 prefetch (PD_CUDA_SKINNY_L2PF*), the qkv -> attention counter
# dependency (PD_CUDA_ATTN_DEP) and the GEMM chain (PD_CUDA_SKINNY_CHAIN): op_bench single, op tests,
# goldens, bench-engine single + decode alternated.
set -u
OUT=$1; mkdir -p "$OUT"
D=${D:-build/gpu-dec14}
T=/tmp/dec14
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
be() {  # name limit env... -- args...
  n=$1; l=$2; shift 2
  [ "$(left)" -lt 10 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  env $envs timeout $(lim $l) $T/pdserve bench-engine --device cuda --model $M --load-format dummy "$@" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  say "$n rc=$? [$envs]"
  grep -E "^decode|pipelined" "$OUT/$n.txt" | sed -E 's/  datasheet.*//; s/ +/ /g; s/floor.*= //; s/back to back, one sync: //; s/decode //' | cut -c1-110
}
ob() {  # name limit env... -- args...
  n=$1; l=$2; shift 2
  [ "$(left)" -lt 10 ] && { say "$n skipped: budget"; return; }
  envs=""; while [ "$1" != "--" ]; do envs="$envs $1"; shift; done; shift
  env $envs timeout $(lim $l) $T/op_bench "$@" > "$OUT/$n.txt" 2>&1
  say "$n rc=$?"
  grep -E "^single|^copy" "$OUT/$n.txt" | sed -E 's/ +/ /g; s/single //; s/host:.*//; s/b2b\+upload.*serial\+upload/ser+up/; s/floor.*GB\/s: //' | cut -c1-120
}
P=PD_CUDA_SKINNY_L2PF
DP=PD_CUDA_ATTN_DEP=1
CH=PD_CUDA_SKINNY_CHAIN=1
# 1. exactness of both dependencies first (the op tests compare bytes with the default path; a
#    hang or a difference drops the knob from everything below)
t=test_cuda_attention_dep
timeout $(lim 30) $T/test_backend_ops $t > "$OUT/ops_$t.txt" 2>&1; rc=$?; say "ops $t rc=$rc"
grep -E "^(ok|FAIL|not ok)|passed|failed|differ" "$OUT/ops_$t.txt" | head -6
[ $rc = 0 ] || { echo "DEP dropped"; DP=PD_CUDA_ATTN_DEP=0; }
t=test_cuda_decode_chain
timeout $(lim 30) $T/test_backend_ops $t > "$OUT/ops_$t.txt" 2>&1; rc=$?; say "ops $t rc=$rc"
grep -E "^(ok|FAIL|not ok)|passed|failed|differ" "$OUT/ops_$t.txt" | head -6
[ $rc = 0 ] || { echo "CHAIN dropped"; CH=PD_CUDA_SKINNY_CHAIN=0; }
# 2. op_bench single (32 weight sets): base + prefetch variants + the dependencies; then a second
#    backend list (drift, combinations)
ob single1 40 OPB_SINGLE_LAYERS=32 OPB_SINGLE_SHORT=1 OPB_SINGLE_VARIANTS="$P=1,${P}_OWN=1,$DP,$CH,$CH+$DP" -- copy single
ob single2 40 OPB_SINGLE_LAYERS=32 OPB_SINGLE_SHORT=1 OPB_SINGLE_VARIANTS="$P=2,$P=1+${P}_OWN=1,$P=1+${P}_BULK=0,$CH+$DP,$CH+$DP+$P=1" -- copy single
# the best prefetch variant (by its first "whole step" back-to-back time in single1/2, no dependency knob)
best=$(cat "$OUT/single1.txt" "$OUT/single2.txt" | awk '/^copy / {f++}
  /^single backend v[0-9]+:/ {v = f "_" $3; sub(":", "", v); e[v] = e[v] (e[v] ? " " : "") $4}
  /^single [a-z0-9]+ +whole step +back-to-back/ {n = ($2 == "rule" ? "rule" : f "_" $2); if (!(n in t)) t[n] = $6}
  END {b = "rule"; for (n in t) if (t[n] < t[b] && e[n] !~ /ATTN_DEP|CHAIN/) b = n; print (b == "rule" ? "" : e[b])}')
echo "best op_bench prefetch variant: [${best:-none}]"
PB=${best:-PD_CUDA_SKINNY_L2PF=1}
# 3. goldens and spec with everything on
if [ -f build/gpu-lead/models.tar.xz ]; then
  mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
  env $DP $CH $PB PD_MODELS_DIR=$T/models timeout $(lim 25) $T/test_gpu_golden > "$OUT/golden.txt" 2>&1; say "golden rc=$? [$DP $CH $PB]"
  grep -E "passed|FAIL|graphs vs eager" "$OUT/golden.txt" | tail -3
  env $DP $CH PD_MODELS_DIR=$T/models timeout $(lim 30) $T/test_gpu_spec > "$OUT/spec.txt" 2>&1; say "spec rc=$? [$DP $CH]"
  grep -E "passed|FAIL" "$OUT/spec.txt" | tail -2
fi
# 3. bench-engine single stream, alternated: base, prefetch, dependency, chain + dependency, all three
S="--only single --ctx 128,4096,8192,32768"
for r in 1 2 3; do
  be sB$r 14 -- $S
  be sP$r 14 $PB -- $S
  be sD$r 14 $DP -- $S
  be sCD$r 14 $CH $DP -- $S
  be sCDP$r 14 $CH $DP $PB -- $S
done
# 4. batched decode (only batch 1 runs M = 1 GEMMs; the rest must be level): base vs all three
A="--only decode --ctx 128 --batches 1,8,32,64,128,256"
for r in 1 2; do
  be dB$r 16 -- $A
  be dCDP$r 16 $CH $DP $PB -- $A
done
say done
