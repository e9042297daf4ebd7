#!/bin/sh
# spec10 helper, session 10, run 2 (issue 15): the fixture end to end on the chosen default.
# Run from the repo root of the lead's checkout: sh build/gpu-spec10/run.sh OUT_DIR (staged as run.sh).
# Staged in build/gpu-spec10/: bins.tar.xz (pdserve, op_bench, test_backend_ops; stripped),
# lib.tar.xz, models/l8b (bench/configs/llama-3-8b + the kjv tokenizer).
# Variants (env switches, same binary): V0 = the binary's default; OLD = main's rule before this
# branch (fused layer to M = 4 on CUDA cores, verify steps of 5 tokens unfused).
# Parts: verify (bench-engine verify steps at batch 1, V0 and OLD), spec (the controlled-acceptance
# fixture at batch 1: EPS x k, --modes off,adaptive,fixed,off, V0; one OLD point for the A/B),
# batch (adaptive vs off at batch 8/32/64), free (ngram / lookahead at batch 1 on a repetitive
# workload, acceptance and tokens/verify reported as measured).
set -u
OUT=$1; mkdir -p "$OUT"
D=build/gpu-spec10
t0=$(date +%s)
(cd $D && tar xJf bins.tar.xz && tar xJf lib.tar.xz)
export LD_LIBRARY_PATH=$D/lib PD_SPEC_STATS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cat $D/COMMIT
left() { echo $(( ${BUDGET:-228} - ($(date +%s) - t0) )); }
lim() { l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
env_of() {
  case $1 in
    V0) echo "";;
    OLD) echo "PD_CUDA_FUSE_MMA_MIN_M=0 PD_CUDA_SKINNY_FUSE_MAX_M=4";;
  esac
}
M=$D/models/l8b
FIX="--model $M --load-format dummy --speculative-method draft --speculative-model $M --speculative-dummy-layers 1"
W="--random-prompt 32 --random-prompts 8"
spec() {  # name variant limit args...
  n=$1; v=$2; l=$3; shift 3
  [ "$(left)" -lt 12 ] && { echo "== $n skipped: budget"; return; }
  env $(env_of $v) timeout $(lim $l) $D/pdserve bench-spec --device cuda "$@" --json "$OUT/$n.json" > "$OUT/$n.txt" 2> "$OUT/$n.err"
  echo "== $n ($v) rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "batch=|summary|workload" "$OUT/$n.txt" | cut -c1-200
  grep -E "spec stats: [0-9]+ steps|spec stats: shape batch 1 x [0-9]+ tokens|draft forwards: " "$OUT/$n.err" | sed 's/.*spec stats: //' | cut -c1-170 | head -8
}
PARTS=${PARTS:-verify spec batch free}
case " $PARTS " in *" verify "*)
  for v in V0 OLD; do
    env $(env_of $v) timeout $(lim 25) $D/pdserve bench-engine --model bench/configs/llama-3-8b --load-format dummy \
      --only verify --verify-tokens 9 --batches 1 --json "$OUT/verify_$v.json" > "$OUT/verify_$v.txt" 2>&1
    echo "== verify $v rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "^verify step" "$OUT/verify_$v.txt" | awk '{print $5, $6}' | tr '\n' ';'; echo
  done;;
esac
case " $PARTS " in *" spec "*)
  for vek in ${SPECS:-V0:0.027:4 OLD:0.027:4 V0:0.025:4 V0:0.029:4 V0:0.027:3 V0:0.027:5}; do
    v=${vek%%:*}; ek=${vek#*:}; e=${ek%:*}; k=${ek#*:}
    spec spec_${v}_${e}_k$k $v 30 $FIX --dummy-residual-scale 1:$e $W --num-speculative-tokens $k --max-tokens 128 \
      --batches 1 --reps 3 --modes off,adaptive,fixed,off
  done;;
esac
case " $PARTS " in *" batch "*)
  spec batch_V0 V0 45 $FIX --dummy-residual-scale 1:0.027 $W --num-speculative-tokens 4 --max-tokens 64 \
    --batches 8,32,64 --reps 3 --modes off,adaptive,off;;
esac
case " $PARTS " in *" free "*)
  spec free_eps0 V0 35 --model $M --load-format dummy --dummy-residual-scale 1:0 --random-prompt 32 --random-prompts 8 --repeat 8 \
    --num-speculative-tokens 4 --max-tokens 128 --batches 1 --reps 3 --modes off,ngram:adaptive,ngram:fixed,lookahead:adaptive,off
  spec free_unscaled V0 35 --model $M --load-format dummy --random-prompt 32 --random-prompts 8 --repeat 8 \
    --num-speculative-tokens 4 --max-tokens 128 --batches 1 --reps 3 --modes off,ngram:adaptive,ngram:fixed,lookahead:adaptive,off;;
esac
echo "total $(( $(date +%s) - t0 )) s"
