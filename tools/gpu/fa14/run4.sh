#!/bin/sh
# fa14 round 4 (commit in COMMIT): round 3's defaults (MB, RSC, descriptors once per tile; *_r3 = that
# binary, 3100697) plus short dependency chains in the softmax (four partial maxima and four partial
# sums per row instead of one chain of 32). *_main = the lead's main binaries of 22:41.
# (a) exactness: fa3_probe (scattered, contig), test_gpu_golden, test_backend_ops attention_prefill;
# (b) op_bench attnpre main / r3 / new alternated x3, diag noload; (c) bench-engine main / r3 / new.
set -u
OUT=$1; mkdir -p "$OUT"
HERE=$(dirname "$0")
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { [ $(( $(date +%s) - T0 )) -lt $1 ]; }
B=/tmp/fa14; rm -rf $B; mkdir -p $B/models
tar xJf "$HERE/bins.tar.xz" -C $B || { echo "unpack failed"; exit 1; }
cat "$HERE/COMMIT"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
el unpacked
ap() { grep -E '^attn prefill' "$1" | awk '{for(i=1;i<=NF;i++) if($i=="TFLOP/s") printf "%s ", $(i-1)}'; }
probe() { n=$1; b=$2; shift 2; env "$@" timeout 12 $B/bin/$b > "$OUT/probe_$n.txt" 2>&1; el "probe $n rc=$?: $(tail -1 "$OUT/probe_$n.txt")"; }
probe new fa3_probe
probe new_contig fa3_probe FA3_PROBE_PAGES=contig
grep -h FAIL "$OUT"/probe_*.txt | head -10
ob() { n=$1; b=$2; shift 2; env "$@" timeout 12 $B/bin/$b attnpre > "$OUT/ob_$n.txt" 2>&1; el "$n: $(ap "$OUT/ob_$n.txt")"; }
echo "== attnpre TFLOP/s: hd128 L=512 2048 8192; hd64 512 2048 8192; hd128 4x2048 (scattered pages)"
for r in 1 2 3; do
  ob main_$r op_bench_main
  ob r3_$r op_bench_r3
  ob new_$r op_bench
done
ob d_noload op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=noload
M="--model bench/configs/llama-3-8b --load-format dummy"
pf() { grep -E '^prefill' "$1" | awk '{for(i=4;i<=NF;i++) if($i=="=") {p=$(i+1); break}; printf "%s ms %s; ", $3, p}'; grep -o 'GEMM 8192^3 [0-9.]* TFLOP/s[^;]*' "$1" | head -1; }
for r in 1 2; do
  for v in main r3 new; do
    left 45 || break
    case $v in main) X=pdserve_main;; r3) X=pdserve_r3;; new) X=pdserve;; esac
    timeout 12 $B/bin/$X bench-engine $M --only prefill > "$OUT/eng_${v}_$r.txt" 2>&1; el "engine $v $r: $(pf "$OUT/eng_${v}_$r.txt")"
  done
done
tar xJf build/gpu-lead/models.tar.xz -C $B/models && ln -sfn "$PWD/models/kjv-llama-6m" $B/models/kjv-llama-6m
PD_MODELS_DIR=$B/models timeout 20 $B/tests/golden/test_gpu_golden > "$OUT/golden.txt" 2>&1; el "test_gpu_golden rc=$?: $(tail -1 "$OUT/golden.txt")"
left 70 && { timeout 32 $B/tests/ops/test_backend_ops attention_prefill > "$OUT/ops.txt" 2>&1; el "test_backend_ops attention_prefill rc=$?: $(tail -1 "$OUT/ops.txt")"; }
el done
