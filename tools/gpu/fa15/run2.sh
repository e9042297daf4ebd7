#!/bin/sh
# fa15 round 2 (commit in COMMIT; old = build/gpu-old = main 0b86b1a). The new binary's defaults have RSE on.
# Knobs measured on top: LKF (lane-parallel page lookups in the producer), DSC (32-bit descriptor words
# before the handshake), PERS (persistent blocks), ARV (copies arrive as they land).
# (a) exactness: fa3_probe (all cases) for each variant, test_gpu_golden + test_backend_ops attention_prefill;
# (b) op_bench attnpre old / new / variants alternated x2, diag noload / nomath;
# (c) bench-engine --only prefill old / new / LKF+DSC alternated, and from idle; (d) ncu source of LKF+DSC.
set -u
OUT=$1; mkdir -p "$OUT"
HERE=$(dirname "$0")
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt $1 ]; }
B=/tmp/fa15; rm -rf $B; mkdir -p $B/old $B/models
tar xJf "$HERE/bins.tar.xz" -C $B || { echo "unpack failed"; exit 1; }
tar xJf build/gpu-old/bins.tar.xz -C $B/old || echo "old unpack failed"
cat "$HERE/COMMIT"; cat build/gpu-old/COMMIT; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
el unpacked
LD="PD_CUDA_FA3_LKF=1 PD_CUDA_FA3_DSC=1"
probe() { n=$1; shift; env "$@" timeout 12 $B/bin/fa3_probe > "$OUT/probe_$n.txt" 2>&1; el "probe $n rc=$?: $(tail -1 "$OUT/probe_$n.txt")"; }
probe new
probe lkf PD_CUDA_FA3_LKF=1
probe dsc PD_CUDA_FA3_DSC=1
probe ld $LD
probe ld_contig $LD FA3_PROBE_PAGES=contig
probe pers $LD PD_CUDA_FA3_PERS=1
PERS_OK=$(tail -1 "$OUT/probe_pers.txt" | grep -c "14/14")
[ "$PERS_OK" = 1 ] && probe pers_contig $LD PD_CUDA_FA3_PERS=1 FA3_PROBE_PAGES=contig
probe arv $LD PD_CUDA_FA3_ARV=1
ARV_OK=$(tail -1 "$OUT/probe_arv.txt" | grep -c "14/14")
grep -h FAIL "$OUT"/probe_*.txt | head -10
ap() { grep -E '^attn prefill' "$1" | awk '{for(i=1;i<=NF;i++) if($i=="TFLOP/s") printf "%s ", $(i-1)}'; }
ob() { n=$1; b=$2; shift 2; env "$@" timeout 12 $b attnpre > "$OUT/ob_$n.txt" 2>&1; el "$n: $(ap "$OUT/ob_$n.txt")"; }
echo "== attnpre TFLOP/s: hd128 L=512 2048 8192; hd64 512 2048 8192; hd128 4x2048 (scattered pages)"
for r in 1 2; do
  ob old_$r $B/old/bin/op_bench
  ob new_$r $B/bin/op_bench
  ob lkf_$r $B/bin/op_bench PD_CUDA_FA3_LKF=1
  ob dsc_$r $B/bin/op_bench PD_CUDA_FA3_DSC=1
  ob ld_$r $B/bin/op_bench $LD
  [ "$PERS_OK" = 1 ] && ob pers_$r $B/bin/op_bench $LD PD_CUDA_FA3_PERS=1
  [ "$ARV_OK" = 1 ] && ob arv_$r $B/bin/op_bench $LD PD_CUDA_FA3_ARV=1
done
ob c_new $B/bin/op_bench OP_BENCH_ATTN_PAGES=contig
ob c_ld $B/bin/op_bench $LD OP_BENCH_ATTN_PAGES=contig
echo "== 8192 only (hd128 first), diagnostics build"
ob d_noload $B/bin/op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=noload
ob d_noload_dsc $B/bin/op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=noload PD_CUDA_FA3_DSC=1
ob d_nomath $B/bin/op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=nomath
ob d_nomath_lkf $B/bin/op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=nomath PD_CUDA_FA3_LKF=1
tar xJf build/gpu-lead/models.tar.xz -C $B/models && ln -sfn "$PWD/models/kjv-llama-6m" $B/models/kjv-llama-6m
env $LD PD_MODELS_DIR=$B/models timeout 20 $B/tests/golden/test_gpu_golden > "$OUT/golden_ld.txt" 2>&1; el "test_gpu_golden LKF+DSC rc=$?: $(tail -1 "$OUT/golden_ld.txt")"
M="--model bench/configs/llama-3-8b --load-format dummy"
pf() { grep -E '^prefill' "$1" | awk '{for(i=4;i<=NF;i++) if($i=="=") {p=$(i+1); break}; printf "%s ms %s; ", $3, p}'; grep -o 'GEMM 8192^3 [0-9.]* TFLOP/s[^;]*' "$1" | head -1; }
eng() { n=$1; x=$2; shift 2; env "$@" timeout 15 $x bench-engine $M --only prefill $EX > "$OUT/eng_$n.txt" 2>&1; el "engine $n: $(pf "$OUT/eng_$n.txt")"; }
EX=""
for r in 1 2; do
  left 120 || break
  eng old_$r $B/old/bin/pdserve
  eng ld_$r $B/bin/pdserve $LD
  eng new_$r $B/bin/pdserve
done
EX="--prefill-idle-ms 300"
left 130 && eng idle_old $B/old/bin/pdserve
left 140 && eng idle_ld $B/bin/pdserve $LD
left 150 && { env $LD timeout 32 $B/tests/ops/test_backend_ops attention_prefill > "$OUT/ops_ld.txt" 2>&1; el "test_backend_ops attention_prefill LKF+DSC rc=$?: $(tail -1 "$OUT/ops_ld.txt")"; }
NCU=/usr/local/cuda/bin/ncu
if [ -x $NCU ] && left 175; then
  env $LD OP_BENCH_ATTNPRE_L=8192 timeout 25 $NCU --clock-control none --set full --import-source no -k regex:k_attn_prefill_fa3 \
    --launch-skip 3 --launch-count 1 -o $B/rep_ld $B/bin/op_bench attnpre > "$OUT/ncu_ld_log.txt" 2>&1
  el "ncu LKF+DSC rc=$?"
  if [ -f $B/rep_ld.ncu-rep ]; then
    timeout 15 $NCU -i $B/rep_ld.ncu-rep --page details > "$OUT/ncu_ld_details.txt" 2>&1
    timeout 15 $NCU -i $B/rep_ld.ncu-rep --page source --print-source sass --csv 2>&1 | xz -6 > "$OUT/src_ld.csv.xz"
    grep -E "SM Frequency|Duration|Issue Slots Busy|Warp Cycles Per Issued|Eligible Warps|Executed Ipc A" "$OUT/ncu_ld_details.txt" | head -8
  fi
fi
el done
