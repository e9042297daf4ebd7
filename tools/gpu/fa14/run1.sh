#!/bin/sh
# fa14 round 1 (commit in COMMIT; *_main = the lead's main binaries of 22:41): prefill attention
# diagnostics, the GQA-packed kernel (PD_CUDA_FA3_GQA) and persistent blocks (PD_CUDA_FA3_PERS).
# (a) fa3_probe (float64 reference) for main, default, GQA=2, GQA=4, ST=2, PERS, GQA=4+PERS, GQA=4+TMA=2 (contig);
# (b) op_bench attnpre main / default / GQA=4 / GQA=4+PERS alternated (scattered pages, all sizes);
# (c) 8k only: diag noload / nomath / nosync for default and GQA=4, ST=2, PERS, PP=0, contig pages, TMA=2;
# (d) bench-engine --only prefill main / GQA=4 alternated; (e) test_backend_ops attention_prefill GQA=4+PERS.
set -u
OUT=$1; mkdir -p "$OUT"
HERE=$(dirname "$0")
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt $1 ]; }
B=/tmp/fa14; rm -rf $B; mkdir -p $B
tar xJf "$HERE/bins.tar.xz" -C $B || { echo "unpack failed"; exit 1; }
cat "$HERE/COMMIT"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
el unpacked
# attnpre figures of one run on one line
ap() { grep -E '^attn prefill' "$1" | awk '{for(i=1;i<=NF;i++) if($i=="TFLOP/s") printf "%s ", $(i-1)}'; }
# probe: NAME BIN ENV...
probe() { n=$1; b=$2; shift 2; env "$@" timeout 20 $B/bin/$b > "$OUT/probe_$n.txt" 2>&1; el "probe $n rc=$?: $(tail -1 "$OUT/probe_$n.txt")"; }
probe main fa3_probe_main
probe def fa3_probe
probe g2 fa3_probe PD_CUDA_FA3_GQA=2
probe g4 fa3_probe PD_CUDA_FA3_GQA=4
probe st2 fa3_probe PD_CUDA_FA3_ST=2
probe pers fa3_probe PD_CUDA_FA3_PERS=1
probe g4pers fa3_probe PD_CUDA_FA3_GQA=4 PD_CUDA_FA3_PERS=1
probe g4tmah_contig fa3_probe PD_CUDA_FA3_GQA=4 PD_CUDA_FA3_TMA=2 FA3_PROBE_PAGES=contig
grep -h FAIL "$OUT"/probe_*.txt | head -20
# op_bench: NAME BIN ENV...
ob() { n=$1; b=$2; shift 2; env "$@" timeout 25 $B/bin/$b attnpre > "$OUT/ob_$n.txt" 2>&1; el "$n: $(ap "$OUT/ob_$n.txt")"; }
echo "== attnpre TFLOP/s: hd128 L=512 2048 8192; hd64 512 2048 8192; hd128 4x2048"
for r in 1 2; do
  ob main_$r op_bench_main
  ob def_$r op_bench
  ob g4_$r op_bench PD_CUDA_FA3_GQA=4
  ob g4pers_$r op_bench PD_CUDA_FA3_GQA=4 PD_CUDA_FA3_PERS=1
done
ob g2 op_bench PD_CUDA_FA3_GQA=2
echo "== 8192 only (hd128, hd64)"
Q=OP_BENCH_ATTNPRE_L=8192
ob d_noload op_bench_diag $Q PD_CUDA_FA3_DIAG=noload
ob d_nomath op_bench_diag $Q PD_CUDA_FA3_DIAG=nomath
ob d_nosync op_bench_diag $Q PD_CUDA_FA3_DIAG=nosync
ob d_g4_noload op_bench_diag $Q PD_CUDA_FA3_DIAG=noload PD_CUDA_FA3_GQA=4
ob d_g4_nomath op_bench_diag $Q PD_CUDA_FA3_DIAG=nomath PD_CUDA_FA3_GQA=4
ob d_g4_nosync op_bench_diag $Q PD_CUDA_FA3_DIAG=nosync PD_CUDA_FA3_GQA=4
ob d_st2_noload op_bench_diag $Q PD_CUDA_FA3_DIAG=noload PD_CUDA_FA3_ST=2
ob q_st2 op_bench $Q PD_CUDA_FA3_ST=2
ob q_pers op_bench $Q PD_CUDA_FA3_PERS=1
ob q_g4st2 op_bench $Q PD_CUDA_FA3_GQA=4 PD_CUDA_FA3_ST=2
ob q_g4pp0 op_bench $Q PD_CUDA_FA3_GQA=4 PD_CUDA_FA3_PP=0
ob q_def_contig op_bench $Q OP_BENCH_ATTN_PAGES=contig
ob q_g4_contig op_bench $Q PD_CUDA_FA3_GQA=4 OP_BENCH_ATTN_PAGES=contig
ob q_g4tmah_contig op_bench $Q PD_CUDA_FA3_GQA=4 PD_CUDA_FA3_TMA=2 OP_BENCH_ATTN_PAGES=contig
ob q_g4perstmah_contig op_bench $Q PD_CUDA_FA3_GQA=4 PD_CUDA_FA3_PERS=1 PD_CUDA_FA3_TMA=2 OP_BENCH_ATTN_PAGES=contig
ob q_main_2 op_bench_main $Q
ob q_g4_2 op_bench $Q PD_CUDA_FA3_GQA=4
ob q_g4pers_2 op_bench $Q PD_CUDA_FA3_GQA=4 PD_CUDA_FA3_PERS=1
left 130 && { timeout 15 $B/bin/op_bench peak > "$OUT/peak.txt" 2>&1; el "peak: $(grep gemm "$OUT/peak.txt")"; }
M="--model bench/configs/llama-3-8b --load-format dummy"
pf() { grep -E '^prefill' "$1" | awk '{for(i=4;i<=NF;i++) if($i=="=") {p=$(i+1); break}; printf "%s ms %s; ", $3, p}'; grep -o 'GEMM 8192^3 [0-9.]* TFLOP/s[^;]*' "$1" | head -1; }
for r in 1 2; do
  for v in main g4; do
    left 145 || break
    case $v in main) X="$B/bin/pdserve_main";; g4) X="env PD_CUDA_FA3_GQA=4 $B/bin/pdserve";; esac
    timeout 30 $X bench-engine $M --only prefill > "$OUT/eng_${v}_$r.txt" 2>&1
    el "engine $v $r: $(pf "$OUT/eng_${v}_$r.txt")"
  done
done
left 140 && { PD_CUDA_FA3_GQA=4 PD_CUDA_FA3_PERS=1 timeout 30 $B/tests/ops/test_backend_ops attention_prefill > "$OUT/ops_g4pers.txt" 2>&1; el "test_backend_ops attention_prefill GQA=4 PERS=1 rc=$?: $(tail -1 "$OUT/ops_g4pers.txt")"; }
el done
