#!/bin/sh
# spec10 helper, session 10, call 2 (issue 15; call 1 ran this script's first version, `git show
# 5dba4d4:tools/gpu/spec10/run.sh`). Run from the repo root of the lead's checkout:
# sh build/gpu-spec10/run.sh OUT_DIR. Staged in build/gpu-spec10/: bins.tar.xz (pdserve, op_bench,
# test_backend_ops; stripped), lib.tar.xz (the libs of /work/devlibs/lib they need), models/l8b
# (bench/configs/llama-3-8b + the kjv tokenizer).
# Parts (env PARTS, in this order; BUDGET 165 s): fusev (op_bench: one layer minus attention at
# M = 1..16 per build), verify (bench-engine verify steps at batch 1 and 8 per variant), ops (the
# tests of the fastest 5-token verify build, if it is a new one; line-buffered), spec (the fixture at
# batch 1, 96 tokens, --serial 4: 4 prompts decoded alone in turn per timed run, so acceptance is
# over 4 requests, not one), batch (adaptive vs off at batch 8 / 32 / 64), free (not by default).
# Variants (env switches, same binary): V0 the default; L4 = the default rule with M = 5 on cuBLASLt
# (PD_CUDA_SKINNY_RULE_MAX_M=4); T5 = fused forms on the tensor-core kernel from M = 5;
# C8 / C8A / C8O = the CUDA-core fused layer to M = 8 (its register build / weights through shared
# memory / 128-register build at M = 5).
set -u
OUT=$1; mkdir -p "$OUT"
D=build/gpu-spec10
t0=$(date +%s)
(cd $D && tar xJf bins.tar.xz && tar xJf lib.tar.xz)
export LD_LIBRARY_PATH=$D/lib PD_SPEC_STATS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cat $D/COMMIT
left() { echo $(( ${BUDGET:-165} - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
env_of() {
  case $1 in
    V0) echo "";;
    L4) echo "PD_CUDA_SKINNY_RULE_MAX_M=4";;
    T5) echo "PD_CUDA_FUSE_MMA_MIN_M=5 PD_CUDA_SKINNY_FUSE_MAX_M=16";;
    C8) echo "PD_CUDA_SKINNY_FUSE_MAX_M=8";;
    C8A) echo "PD_CUDA_SKINNY_FUSE_MAX_M=8 PD_CUDA_SKINNY_ASYNC=1";;
    C8O) echo "PD_CUDA_SKINNY_FUSE_MAX_M=8 PD_CUDA_SKINNY_OCC4=1";;
    # call 1's other variants (all measured slower, NOTES.md session 10 spec10)
    T5P) echo "PD_CUDA_FUSE_MMA_MIN_M=5 PD_CUDA_SKINNY_FUSE_MAX_M=16 PD_CUDA_SKINNY_MMA_PIPE=1";;
    T1) echo "PD_CUDA_FUSE_MMA_MIN_M=1 PD_CUDA_SKINNY_FUSE_MAX_M=16";;
    T5L) echo "PD_CUDA_FUSE_MMA_MIN_M=5 PD_CUDA_SKINNY_FUSE_MAX_M=16 PD_CUDA_SKINNY_MMA_LOADS=32";;
    Q5) echo "PD_CUDA_FUSE_MMA_MIN_M=5 PD_CUDA_SKINNY_FUSE_MAX_M=16 PD_CUDA_FUSE_MMA_FORMS=1 PD_CUDA_SKINNY_MMA_PIPE=1";;
  esac
}
M=$D/models/l8b
FIX="--model $M --load-format dummy --speculative-method draft --speculative-model $M --speculative-dummy-layers 1"
W="--random-prompt 32 --random-prompts 8"
spec() {  # name variant limit args...
  n=$1; v=$2; l=$3; shift 3
  [ "$(left)" -lt 18 ] && { echo "== $n skipped: budget"; return; }
  env $(env_of $v) timeout $(lim $l) $D/pdserve bench-spec --device cuda "$@" --json "$OUT/$n.json" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  echo "== $n ($v) rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "batch=|summary" "$OUT/$n.txt" | sed 's/ (the others.*//' | cut -c1-210
  grep -E "spec stats: [0-9]+ steps|spec stats: shape batch 1 x [0-9]+ tokens|draft forwards: [0-9]" "$OUT/$n.err" | sed 's/.*spec stats: //' | cut -c1-120 | head -10
}
PARTS=${PARTS:-fusev verify ops spec batch}
case " $PARTS " in *" fusev "*)
  timeout $(lim 20) $D/op_bench fusev > "$OUT/fusev.txt" 2>&1
  echo "== fusev rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "copy|fusev" "$OUT/fusev.txt" | sed 's/  (floor.*//' | cut -c1-330;;
esac
case " $PARTS " in *" verify "*)
  for v in ${VVARS:-V0 L4 T5 C8A C8O}; do
    [ "$(left)" -lt 10 ] && { echo "== verify $v skipped: budget"; continue; }
    env $(env_of $v) timeout $(lim 20) $D/pdserve bench-engine --model bench/configs/llama-3-8b --load-format dummy \
      --only verify --verify-tokens 9 --batches 1,8 --json "$OUT/verify_$v.json" > "$OUT/verify_$v.txt" 2>&1
    echo "== verify $v rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "^verify step" "$OUT/verify_$v.txt" | awk '{print $3, $5, $6}' | sed 's/batch=//; s/tokens\/seq=/q/' | tr '\n' ';' | cut -c1-300; echo
  done;;
esac
BEST=V0
best=$(for f in "$OUT"/verify_*.txt; do
  [ -e "$f" ] || continue
  awk -v v="$(basename "$f" .txt | sed 's/verify_//')" '/^verify step/ && /batch=1 / && /tokens\/seq=5 / { print $6, v }' "$f"
done | sort -n | head -1 | awk '{print $2}')
[ -n "$best" ] && BEST=$best
echo "fastest 5-token verify step: $BEST"
case " $PARTS " in *" ops "*)
  SB=; command -v stdbuf > /dev/null && SB="stdbuf -oL"
  for t in cuda_verify_fused:40; do
    [ "$BEST" = V0 ] || [ "$BEST" = L4 ] && break  # (the default's kernels: the lead's own test run)
    timeout $(lim ${t#*:}) $SB $D/test_backend_ops ${t%:*} > "$OUT/ops_${t%:*}.txt" 2>&1
    echo "== ops ${t%:*} rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "^(ok|FAIL)|passed|check failed" "$OUT/ops_${t%:*}.txt" | head -8
  done;;
esac
specs() {
  for vek in "$@"; do
    v=${vek%%:*}; ek=${vek#*:}; e=${ek%:*}; k=${ek#*:}
    [ "$v" = BEST ] && v=$BEST
    [ -e "$OUT/spec_${v}_${e}_k$k.txt" ] && continue  # (BEST = V0: done)
    spec spec_${v}_${e}_k$k $v 30 $FIX --dummy-residual-scale 1:$e $W --num-speculative-tokens $k --max-tokens 96 \
      --batches 1 --serial 4 --reps 2 --modes off,adaptive,fixed,off
  done
}
case " $PARTS " in *" spec "*) specs ${SPECS:-V0:0.027:4 BEST:0.027:4 BEST:0.024:4 BEST:0.030:4};; esac
case " $PARTS " in *" batch "*)
  spec batch_V0 V0 30 $FIX --dummy-residual-scale 1:0.027 $W --num-speculative-tokens 4 --max-tokens 64 \
    --batches 8,32,64 --reps 3 --modes off,adaptive,off;;
esac
case " $PARTS " in *" spec "*) specs ${SPECS2:-BEST:0.027:3 BEST:0.027:5};; esac
case " $PARTS " in *" free "*)
  spec free_eps0 V0 30 --model $M --load-format dummy --dummy-residual-scale 1:0 --random-prompt 32 --random-prompts 8 --repeat 8 \
    --num-speculative-tokens 4 --max-tokens 128 --batches 1 --serial 4 --reps 2 --modes off,ngram:adaptive,ngram:fixed,lookahead:adaptive,off;;
esac
echo "total $(( $(date +%s) - t0 )) s"
