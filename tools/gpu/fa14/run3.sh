#!/bin/sh
# fa14 round 3 (confirmation, commit in COMMIT; *_main = the lead's main binaries of 22:41): new defaults
# PD_CUDA_FA3_MB=1 (the causal mask in its own code path, only on tiles crossing the diagonal: ~36% fewer
# consumer instructions on the others) and PD_CUDA_FA3_RSC=1 (O rescaled only when a row's max changed),
# wgmma descriptors built once per tile. (a) exactness: fa3_probe new / new with MB=0 RSC=0 / main;
# test_backend_ops attention_prefill; test_gpu_golden; (b) op_bench attnpre main / new / new MB=0
# alternated x3 (+ contig x1); (c) bench-engine --only prefill main / new alternated x2.
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
probe old fa3_probe PD_CUDA_FA3_MB=0 PD_CUDA_FA3_RSC=0
grep -h FAIL "$OUT"/probe_*.txt | head -10
ob() { n=$1; b=$2; shift 2; env "$@" timeout 12 $B/bin/$b attnpre > "$OUT/ob_$n.txt" 2>&1; el "$n: $(ap "$OUT/ob_$n.txt")"; }
echo "== attnpre TFLOP/s: hd128 L=512 2048 8192; hd64 512 2048 8192; hd128 4x2048 (scattered pages)"
for r in 1 2 3; do
  ob main_$r op_bench_main
  ob new_$r op_bench
  ob mb0_$r op_bench PD_CUDA_FA3_MB=0
done
ob c_main op_bench_main OP_BENCH_ATTN_PAGES=contig
ob c_new op_bench OP_BENCH_ATTN_PAGES=contig
ob d_noload op_bench_diag OP_BENCH_ATTNPRE_L=8192 PD_CUDA_FA3_DIAG=noload
M="--model bench/configs/llama-3-8b --load-format dummy"
pf() { grep -E '^prefill' "$1" | awk '{for(i=4;i<=NF;i++) if($i=="=") {p=$(i+1); break}; printf "%s ms %s; ", $3, p}'; grep -o 'GEMM 8192^3 [0-9.]* TFLOP/s[^;]*' "$1" | head -1; }
for r in 1 2; do
  left 40 || break
  timeout 12 $B/bin/pdserve_main bench-engine $M --only prefill > "$OUT/eng_main_$r.txt" 2>&1; el "engine main $r: $(pf "$OUT/eng_main_$r.txt")"
  timeout 12 $B/bin/pdserve bench-engine $M --only prefill > "$OUT/eng_new_$r.txt" 2>&1; el "engine new $r: $(pf "$OUT/eng_new_$r.txt")"
done
tar xJf build/gpu-lead/models.tar.xz -C $B/models && ln -sfn "$PWD/models/kjv-llama-6m" $B/models/kjv-llama-6m
PD_MODELS_DIR=$B/models timeout 20 $B/tests/golden/test_gpu_golden > "$OUT/golden.txt" 2>&1; el "test_gpu_golden rc=$?: $(tail -1 "$OUT/golden.txt")"
left 55 && { timeout 32 $B/tests/ops/test_backend_ops attention_prefill > "$OUT/ops.txt" 2>&1; el "test_backend_ops attention_prefill rc=$?: $(tail -1 "$OUT/ops.txt")"; }
el done
