#!/bin/sh
# dec14 helper, session 14 (issue 17: single stream ctx 128 robustly >= 190 tok/s).
# Run from the repo root of the lead's checkout: sh build/gpu-dec14/run.sh OUT_DIR. Staged in
# build/gpu-dec14/ (tools/gpu/dec14/stage.sh): bins.tar.xz (pdserve, op_bench, test_backend_ops,
# test_gpu_golden, test_gpu_spec of COMMIT, stripped), this script, LIMIT. Libraries: /tmp/gpulib/lib
# (the lead's wrapper). Model: the tracked 8B shape config bench/configs/llama-3-8b, dummy weights;
# models for test_gpu_golden from build/gpu-lead/models.tar.xz + the tracked models/kjv-llama-6m.
# Round 2: the norm weight prefetched before the PDL wait (PD_CUDA_SKINNY_NORM_PF=1|2; op_bench
# with shared and with per-layer norm weights, OPB_SINGLE_NORMS=1), the M = 1 skinny kernel at 6
# blocks per SM (PD_CUDA_SKINNY_OCC6=1|2), the qkv -> attention counter dependency with a relaxed
# poll (PD_CUDA_ATTN_DEP=1), the short-context decode attention in one partition
# (PD_CUDA_ATTN_MIN_PART=256) of 4-warp blocks (PD_CUDA_ATTN_W4=1): op_bench single, goldens,
# bench-engine single + decode alternated, op tests.
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
O=PD_CUDA_SKINNY_OCC6
N=PD_CUDA_SKINNY_NORM_PF
DP=PD_CUDA_ATTN_DEP=1
AM=PD_CUDA_ATTN_MIN_PART=256
AW=PD_CUDA_ATTN_W4=1
# 1. op_bench single (32 weight sets): shared norm weights (as before), then each set its own
ob single1 30 OPB_SINGLE_LAYERS=32 OPB_SINGLE_SHORT=1 OPB_SINGLE_VARIANTS="$N=1,$N=2,$O=1,$O=2,$AM+$AW" -- copy single
ob single2 30 OPB_SINGLE_LAYERS=32 OPB_SINGLE_SHORT=1 OPB_SINGLE_NORMS=1 OPB_SINGLE_VARIANTS="$N=1,$N=2,$DP,$AM,$O=2+$N=1" -- copy single
pick() {  # the variant matching $1 (awk regex) with the lowest mean "whole step" back-to-back time in files $2...
  want=$1; shift
  cat "$@" | awk -v want="$want" '/^copy / {f++}
  /^single backend v[0-9]+:/ {v = f "_" $3; sub(":", "", v); e[v] = e[v] (e[v] ? " " : "") $4}
  /^single [a-z0-9]+ +whole step +back-to-back/ {if ($2 == "rule") next; k = e[f "_" $2]; s[k] += $6; c[k]++}
  END {b = ""; for (k in s) if (k ~ want && k !~ /ATTN_DEP/ && (b == "" || s[k] / c[k] < s[b] / c[b])) b = k; print b}'
}
NB=$(pick "^PD_CUDA_SKINNY_NORM_PF=.$" "$OUT/single2.txt"); NB=${NB:-$N=1}
OB=$(pick "^PD_CUDA_SKINNY_OCC6=.$" "$OUT/single1.txt"); OB=${OB:-$O=2}
AB=$(pick MIN_PART "$OUT/single1.txt" "$OUT/single2.txt"); AB=${AB:-$AM}
echo "better: norm prefetch [$NB], OCC6 [$OB], attention [$AB]"
# 2. exactness with the knobs: goldens, spec (a prefetch cannot change a result; the others can)
if [ -f build/gpu-lead/models.tar.xz ]; then
  mkdir -p $T/models && tar xJf build/gpu-lead/models.tar.xz -C $T/models && ln -sfn "$(pwd)/models/kjv-llama-6m" $T/models/kjv-llama-6m
  env $NB $O=2 $AM PD_MODELS_DIR=$T/models timeout $(lim 25) $T/test_gpu_golden > "$OUT/golden.txt" 2>&1; say "golden rc=$? [$NB $O=2 $AM]"
  grep -E "passed|FAIL|graphs vs eager" "$OUT/golden.txt" | tail -3
  env $AM $AW PD_MODELS_DIR=$T/models timeout $(lim 25) $T/test_gpu_golden > "$OUT/golden2.txt" 2>&1; say "golden rc=$? [$AM $AW]"
  grep -E "passed|FAIL|graphs vs eager" "$OUT/golden2.txt" | tail -3
  env $NB $O=2 PD_MODELS_DIR=$T/models timeout $(lim 30) $T/test_gpu_spec > "$OUT/spec.txt" 2>&1; say "spec rc=$? [$NB $O=2]"
  grep -E "passed|FAIL" "$OUT/spec.txt" | tail -2
fi
# 3. bench-engine single stream, alternated: base, norm prefetch, OCC6, attention, all three
S="--only single --ctx 128,4096,8192,32768"
for r in 1 2 3; do
  be sB$r 14 -- $S
  be sN$r 14 $NB -- $S
  be sO$r 14 $OB -- $S
  be sA$r 14 $AB -- $S
  be sNOA$r 14 $NB $OB $AB -- $S
done
# 4. batched decode (only batch 1 runs M = 1 GEMMs; the rest must be level): base vs all three
A="--only decode --ctx 128 --batches 1,8,32,64,128,256"
for r in 1 2; do
  be dB$r 16 -- $A
  be dNOA$r 16 $NB $OB $AB -- $A
done
# 5. op tests: the fused forms on the OCC6 build (every form) against the CPU reference; the dependency
env $O=2 timeout $(lim 25) $T/test_backend_ops test_cuda_matmul_fused > "$OUT/ops_matmul_fused.txt" 2>&1; say "ops matmul_fused [$O=2] rc=$?"
grep -E "^(ok|FAIL|not ok)|passed|failed" "$OUT/ops_matmul_fused.txt" | head -4
env $O=2 timeout $(lim 25) $T/test_backend_ops test_cuda_fused_rope > "$OUT/ops_fused_rope.txt" 2>&1; say "ops fused_rope [$O=2] rc=$?"
grep -E "^(ok|FAIL|not ok)|passed|failed" "$OUT/ops_fused_rope.txt" | head -4
timeout $(lim 25) $T/test_backend_ops test_cuda_attention_dep > "$OUT/ops_dep.txt" 2>&1; say "ops attention_dep rc=$?"
grep -E "^(ok|FAIL|not ok)|passed|failed|differ" "$OUT/ops_dep.txt" | head -4
say done
