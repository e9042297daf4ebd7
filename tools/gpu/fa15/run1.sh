#!/bin/sh
# fa15 round 1 (commit in COMMIT): diagnostics of the consumers at the SASS level plus two knobs.
# (a) the SASS of the default hd 128 kernel (cuobjdump / nvdisasm when the machine has them) and an ncu
#     report with source counters (per-instruction executed counts and stall samples), printed as SASS;
# (b) fa3_probe for RSE, R240, RSE+R240, PERS (scattered and consecutive pages), PERS+RSE;
# (c) op_bench attnpre old (build/gpu-old = main 0b86b1a) / new / RSE / R240 / RSE+R240 / PERS / PERS+RSE
#     alternated x2, diag noload; test_backend_ops attention_prefill with PERS.
set -u
OUT=$1; mkdir -p "$OUT"
HERE=$(dirname "$0")
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt $1 ]; }
B=/tmp/fa15; rm -rf $B; mkdir -p $B/old
tar xJf "$HERE/bins.tar.xz" -C $B || { echo "unpack failed"; exit 1; }
tar xJf build/gpu-old/bins.tar.xz -C $B/old || echo "old unpack failed"
cat "$HERE/COMMIT"; cat build/gpu-old/COMMIT; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
el unpacked
ls /usr/local/cuda/bin > "$OUT/cuda_bin.txt" 2>&1
ap() { grep -E '^attn prefill' "$1" | awk '{for(i=1;i<=NF;i++) if($i=="TFLOP/s") printf "%s ", $(i-1)}'; }
probe() { n=$1; shift; env "$@" timeout 12 $B/bin/fa3_probe > "$OUT/probe_$n.txt" 2>&1; el "probe $n rc=$?: $(tail -1 "$OUT/probe_$n.txt")"; }
probe rse PD_CUDA_FA3_RSE=1
probe r240 PD_CUDA_FA3_R240=1
probe both PD_CUDA_FA3_RSE=1 PD_CUDA_FA3_R240=1
probe pers PD_CUDA_FA3_PERS=1
PERS_OK=$(tail -1 "$OUT/probe_pers.txt" | grep -c "14/14")
if [ "$PERS_OK" = 1 ]; then
  probe pers_contig PD_CUDA_FA3_PERS=1 FA3_PROBE_PAGES=contig
  probe pers_rse PD_CUDA_FA3_PERS=1 PD_CUDA_FA3_RSE=1
fi
grep -h FAIL "$OUT"/probe_*.txt | head -10
ob() { n=$1; b=$2; shift 2; env "$@" timeout 12 $b attnpre > "$OUT/ob_$n.txt" 2>&1; el "$n: $(ap "$OUT/ob_$n.txt")"; }
echo "== attnpre TFLOP/s: hd128 L=512 2048 8192; hd64 512 2048 8192; hd128 4x2048 (scattered pages)"
for r in 1 2; do
  ob old_$r $B/old/bin/op_bench
  ob new_$r $B/bin/op_bench
  ob rse_$r $B/bin/op_bench PD_CUDA_FA3_RSE=1
  ob r240_$r $B/bin/op_bench PD_CUDA_FA3_R240=1
  ob both_$r $B/bin/op_bench PD_CUDA_FA3_RSE=1 PD_CUDA_FA3_R240=1
  [ "$PERS_OK" = 1 ] && ob pers_$r $B/bin/op_bench PD_CUDA_FA3_PERS=1
  [ "$PERS_OK" = 1 ] && ob persrse_$r $B/bin/op_bench PD_CUDA_FA3_PERS=1 PD_CUDA_FA3_RSE=1
done
echo "== 8192 only (hd128, hd64), diagnostics build"
for r in 1 2; do
  ob d_noload_$r $B/bin/op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=noload
  ob d_noload_rse_$r $B/bin/op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=noload PD_CUDA_FA3_RSE=1
  ob d_noload_r240_$r $B/bin/op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=noload PD_CUDA_FA3_R240=1
done
if [ "$PERS_OK" = 1 ]; then
  PD_CUDA_FA3_PERS=1 timeout 40 $B/tests/ops/test_backend_ops attention_prefill > "$OUT/ops_pers.txt" 2>&1; el "test_backend_ops attention_prefill PERS rc=$?: $(tail -1 "$OUT/ops_pers.txt")"
fi
# (a) SASS. The default hd 128 kernel: flags PP|OVL|RSC|MB = 5186.
K='_Z18k_attn_prefill_fa3ILi128ELi5186EEvPK13__nv_bfloat16S2_S2_PS0_PKiS5_S5_S5_iiiiiiif14CUtensorMap_stS6_S6_S6_'
CB=/usr/local/cuda/bin
if [ -x $CB/cuobjdump ]; then
  timeout 40 $CB/cuobjdump -sass -fun "$K" $B/bin/op_bench > $B/sass_def.txt 2>&1; el "cuobjdump rc=$? $(wc -l < $B/sass_def.txt) lines"
  xz -6 -c $B/sass_def.txt > "$OUT/sass_def.txt.xz"
else
  el "no cuobjdump"
fi
NCU=$(command -v ncu || ls $CB/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
el "ncu: ${NCU:-none}"
if [ -n "$NCU" ] && left 120; then
  $NCU --version | tail -1
  OP_BENCH_ATTNPRE_L=8192 timeout 60 $NCU --clock-control none --set full --import-source no -k regex:k_attn_prefill_fa3 \
    --launch-skip 3 --launch-count 1 -o $B/rep_def $B/bin/op_bench attnpre > "$OUT/ncu_def_log.txt" 2>&1
  el "ncu default rc=$?"
  if [ -f $B/rep_def.ncu-rep ]; then
    timeout 30 $NCU -i $B/rep_def.ncu-rep --page details > "$OUT/ncu_def_details.txt" 2>&1
    timeout 30 $NCU -i $B/rep_def.ncu-rep --page source --print-source sass --csv > $B/src_def.csv 2>&1
    el "source page rc=$? $(wc -l < $B/src_def.csv) lines"
    [ $(wc -l < $B/src_def.csv) -lt 100 ] && { timeout 30 $NCU -i $B/rep_def.ncu-rep --page source --print-source sass > $B/src_def.csv 2>&1; el "source page (text) rc=$? $(wc -l < $B/src_def.csv) lines"; }
    xz -6 -c $B/src_def.csv > "$OUT/src_def.csv.xz"
    grep -E "SM Frequency|Duration|Issue Slots Busy|Tensor|Warp Cycles Per Issued|Eligible Warps|Executed Ipc A" "$OUT/ncu_def_details.txt" | head -12
  fi
  left 150 && { OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=noload timeout 40 $NCU --clock-control none --set full --import-source no -k regex:k_attn_prefill_fa3 \
    --launch-skip 3 --launch-count 1 -o $B/rep_nl $B/bin/op_bench_diag attnpre > "$OUT/ncu_nl_log.txt" 2>&1
    el "ncu noload rc=$?"
    [ -f $B/rep_nl.ncu-rep ] && timeout 30 $NCU -i $B/rep_nl.ncu-rep --page source --print-source sass --csv 2>&1 | xz -6 > "$OUT/src_nl.csv.xz"
    [ -f $B/rep_nl.ncu-rep ] && timeout 30 $NCU -i $B/rep_nl.ncu-rep --page details > "$OUT/ncu_nl_details.txt" 2>&1; }
fi
ls -la "$OUT"
el done
