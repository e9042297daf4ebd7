#!/bin/sh
# fa15 round 3 (commit in COMMIT; old = build/gpu-old = main 0b86b1a). New defaults: RSE everywhere, ARV + LKF
# at head_dim 128 (head_dim 64 keeps KVS). Variants by knob: r2 = ARV=0 LKF=0 (round 2's default), a = ARV
# without LKF (hd 64: ARV instead of KVS), al = ARV + LKF at both head dims, ald = + DSC, p / pa = PERS with
# ARV, with / without LKF.
# (a) exactness: fa3_probe, test_gpu_golden, test_gpu_spec, test_backend_ops attention_prefill (defaults);
# (b) op_bench attnpre alternated x2, diag; (c) bench-engine --only prefill old / new alternated x3, PERS x2,
# from idle; (d) ncu of the new default.
set -u
OUT=$1; mkdir -p "$OUT"
HERE=$(dirname "$0")
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt $1 ]; }
B=/tmp/fa15; rm -rf $B; mkdir -p $B/old $B/models
tar xJf "$HERE/bins.tar.xz" -C $B || { echo "unpack failed"; exit 1; }
tar xJf build/gpu-old/bins.tar.xz -C $B/old || echo "old unpack failed"
tar xJf build/gpu-lead/models.tar.xz -C $B/models && ln -sfn "$PWD/models/kjv-llama-6m" $B/models/kjv-llama-6m
cat "$HERE/COMMIT"; cat build/gpu-old/COMMIT; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
el unpacked
probe() { n=$1; shift; env "$@" timeout 12 $B/bin/fa3_probe > "$OUT/probe_$n.txt" 2>&1; el "probe $n rc=$?: $(tail -1 "$OUT/probe_$n.txt")"; }
probe new
probe new_contig FA3_PROBE_PAGES=contig
probe a PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=0
probe al PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=1
probe p PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=1 PD_CUDA_FA3_PERS=1
P_OK=$(tail -1 "$OUT/probe_p.txt" | grep -c "14/14")
[ "$P_OK" = 1 ] && probe p_contig PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=1 PD_CUDA_FA3_PERS=1 FA3_PROBE_PAGES=contig
grep -h FAIL "$OUT"/probe_*.txt | head -10
ap() { grep -E '^attn prefill' "$1" | awk '{for(i=1;i<=NF;i++) if($i=="TFLOP/s") printf "%s ", $(i-1)}'; }
ob() { n=$1; b=$2; shift 2; env "$@" timeout 12 $b attnpre > "$OUT/ob_$n.txt" 2>&1; el "$n: $(ap "$OUT/ob_$n.txt")"; }
echo "== attnpre TFLOP/s: hd128 L=512 2048 8192; hd64 512 2048 8192; hd128 4x2048 (scattered pages)"
for r in 1 2; do
  ob old_$r $B/old/bin/op_bench
  ob r2_$r $B/bin/op_bench PD_CUDA_FA3_ARV=0 PD_CUDA_FA3_LKF=0
  ob new_$r $B/bin/op_bench
  ob a_$r $B/bin/op_bench PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=0
  ob al_$r $B/bin/op_bench PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=1
  ob ald_$r $B/bin/op_bench PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=1 PD_CUDA_FA3_DSC=1
  [ "$P_OK" = 1 ] && ob p_$r $B/bin/op_bench PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=1 PD_CUDA_FA3_PERS=1
  [ "$P_OK" = 1 ] && ob pa_$r $B/bin/op_bench PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=0 PD_CUDA_FA3_PERS=1
done
ob c_old $B/old/bin/op_bench OP_BENCH_ATTN_PAGES=contig
ob c_new $B/bin/op_bench OP_BENCH_ATTN_PAGES=contig
echo "== 8192 only (hd128 first), diagnostics build"
ob d_noload $B/bin/op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=noload
ob d_nomath $B/bin/op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=nomath
export PD_MODELS_DIR=$B/models
timeout 20 $B/tests/golden/test_gpu_golden > "$OUT/golden.txt" 2>&1; el "test_gpu_golden rc=$?: $(tail -1 "$OUT/golden.txt")"
timeout 30 $B/tests/golden/test_gpu_spec > "$OUT/spec.txt" 2>&1; el "test_gpu_spec rc=$?: $(tail -1 "$OUT/spec.txt")"
M="--model bench/configs/llama-3-8b --load-format dummy"
pf() { grep -E '^prefill' "$1" | awk '{for(i=4;i<=NF;i++) if($i=="=") {p=$(i+1); break}; printf "%s ms %s; ", $3, p}'; grep -o 'GEMM 8192^3 [0-9.]* TFLOP/s[^;]*' "$1" | head -1; }
eng() { n=$1; x=$2; shift 2; env "$@" timeout 15 $x bench-engine $M --only prefill $EX > "$OUT/eng_$n.txt" 2>&1; el "engine $n: $(pf "$OUT/eng_$n.txt")"; }
EX=""
for r in 1 2 3; do
  left 120 || break
  eng old_$r $B/old/bin/pdserve
  eng new_$r $B/bin/pdserve
  [ "$P_OK" = 1 ] && [ $r -le 2 ] && eng p_$r $B/bin/pdserve PD_CUDA_FA3_PERS=1
done
EX="--prefill-idle-ms 300"
left 130 && eng idle_old $B/old/bin/pdserve
left 140 && eng idle_new $B/bin/pdserve
left 150 && { timeout 32 $B/tests/ops/test_backend_ops attention_prefill > "$OUT/ops.txt" 2>&1; el "test_backend_ops attention_prefill rc=$?: $(tail -1 "$OUT/ops.txt")"; }
NCU=/usr/local/cuda/bin/ncu
if [ -x $NCU ] && left 178; then
  OP_BENCH_ATTNPRE_L=8192 timeout 20 $NCU --clock-control none --set full --import-source no -k regex:k_attn_prefill_fa3 \
    --launch-skip 3 --launch-count 1 -o $B/rep_new $B/bin/op_bench attnpre > "$OUT/ncu_new_log.txt" 2>&1
  el "ncu new rc=$?"
  if [ -f $B/rep_new.ncu-rep ]; then
    timeout 8 $NCU -i $B/rep_new.ncu-rep --page details > "$OUT/ncu_new_details.txt" 2>&1
    timeout 8 $NCU -i $B/rep_new.ncu-rep --page source --print-source sass --csv 2>&1 | xz -6 > "$OUT/src_new.csv.xz"
    grep -E "SM Frequency|Duration|Issue Slots Busy|Warp Cycles Per Issued|Eligible Warps|Executed Ipc A" "$OUT/ncu_new_details.txt" | head -8
  fi
fi
el done
