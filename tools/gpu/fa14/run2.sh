#!/bin/sh
# fa14 round 2 (commit in COMMIT; *_main = the lead's main binaries of 22:41). The kernel is main's
# plus: PD_CUDA_FA3_RSC=1 (O rescaled only when a row of the warp changed its max), diag nosync, and
# diag noload with real data in the ring's stages.
# (a) fa3_probe main / default / RSC=1; (b) op_bench attnpre main / default / RSC alternated x2;
# (c) 8k: diag noload / nomath / nosync, noload+RSC, contig pages default / TMA=2 / TMA=2+RSC;
# (d) bench-engine --only prefill main / RSC alternated x2, then --prefill-idle-ms 300 each;
# (e) ncu of the 8k hd128 kernel (default, diag noload), clocks not locked.
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
ap() { grep -E '^attn prefill' "$1" | awk '{for(i=1;i<=NF;i++) if($i=="TFLOP/s") printf "%s ", $(i-1)}'; }
probe() { n=$1; b=$2; shift 2; env "$@" timeout 15 $B/bin/$b > "$OUT/probe_$n.txt" 2>&1; el "probe $n rc=$?: $(tail -1 "$OUT/probe_$n.txt")"; }
probe main fa3_probe_main
probe def fa3_probe
probe rsc fa3_probe PD_CUDA_FA3_RSC=1
probe rsc_tmah_contig fa3_probe PD_CUDA_FA3_RSC=1 PD_CUDA_FA3_TMA=2 FA3_PROBE_PAGES=contig
grep -h FAIL "$OUT"/probe_*.txt | head -20
ob() { n=$1; b=$2; shift 2; env "$@" timeout 15 $B/bin/$b attnpre > "$OUT/ob_$n.txt" 2>&1; el "$n: $(ap "$OUT/ob_$n.txt")"; }
echo "== attnpre TFLOP/s: hd128 L=512 2048 8192; hd64 512 2048 8192; hd128 4x2048 (scattered pages)"
for r in 1 2 3; do
  ob main_$r op_bench_main
  ob def_$r op_bench
  ob rsc_$r op_bench PD_CUDA_FA3_RSC=1
done
echo "== contig pages"
for r in 1 2; do
  ob c_main_$r op_bench_main OP_BENCH_ATTN_PAGES=contig
  ob c_rsc_$r op_bench PD_CUDA_FA3_RSC=1 OP_BENCH_ATTN_PAGES=contig
  ob c_tmah_$r op_bench PD_CUDA_FA3_TMA=2 OP_BENCH_ATTN_PAGES=contig
  ob c_tmahrsc_$r op_bench PD_CUDA_FA3_TMA=2 PD_CUDA_FA3_RSC=1 OP_BENCH_ATTN_PAGES=contig
done
echo "== 8192 only (hd128, hd64), diagnostics build"
Q=OP_BENCH_ATTNPRE_L=8192
for r in 1 2; do
  ob d_noload_$r op_bench_diag $Q PD_CUDA_FA3_DIAG=noload
  ob d_nomath_$r op_bench_diag $Q PD_CUDA_FA3_DIAG=nomath
  ob d_nosync_$r op_bench_diag $Q PD_CUDA_FA3_DIAG=nosync
  ob d_noloadrsc_$r op_bench_diag $Q PD_CUDA_FA3_DIAG=noload PD_CUDA_FA3_RSC=1
done
echo "== sustained 8k runs (400 calls) with nvidia-smi sampling every 20 ms: median SM MHz / W of the loaded samples"
smi() { n=$1; b=$2; shift 2
  nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader,nounits -lms 20 > "$OUT/smi_$n.txt" 2>&1 &
  P=$!; sleep 0.3
  env $Q OP_BENCH_ATTNPRE_REPS=400 "$@" timeout 15 $B/bin/$b attnpre > "$OUT/ob_long_$n.txt" 2>&1
  kill $P 2>/dev/null; wait $P 2>/dev/null
  s="$(awk -F', ' '$2 > 250 {print $1}' "$OUT/smi_$n.txt" | sort -n | awk '{a[NR]=$1} END {if (NR) printf "%d samples, MHz median %s", NR, a[int((NR+1)/2)]}'), W median $(awk -F', ' '$2 > 250 {print $2}' "$OUT/smi_$n.txt" | sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]}')"
  el "long $n: $(ap "$OUT/ob_long_$n.txt")| $s"; }
smi def op_bench
smi noload op_bench_diag PD_CUDA_FA3_DIAG=noload
smi nomath op_bench_diag PD_CUDA_FA3_DIAG=nomath
smi rsc op_bench PD_CUDA_FA3_RSC=1
M="--model bench/configs/llama-3-8b --load-format dummy"
pf() { grep -E '^prefill' "$1" | awk '{for(i=4;i<=NF;i++) if($i=="=") {p=$(i+1); break}; printf "%s ms %s; ", $3, p}'; grep -o 'GEMM 8192^3 [0-9.]* TFLOP/s[^;]*' "$1" | head -1; }
eng() { n=$1; x=$2; shift 2; env "$@" timeout 25 $B/bin/$x bench-engine $M --only prefill $EX > "$OUT/eng_$n.txt" 2>&1; el "engine $n: $(pf "$OUT/eng_$n.txt")"; }
EX=""
for r in 1 2; do
  left 95 || break
  eng main_$r pdserve_main
  eng rsc_$r pdserve PD_CUDA_FA3_RSC=1
done
EX="--prefill-idle-ms 300"
left 110 && eng idle_main pdserve_main
left 120 && eng idle_rsc pdserve PD_CUDA_FA3_RSC=1
grep -E '^prefill|GEMM' "$OUT/eng_main_1.txt" | head -8
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
el "ncu: ${NCU:-none}"
SEC="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy"
if [ -n "$NCU" ]; then
  left 130 && { env $Q timeout 25 $NCU --clock-control none -k regex:k_attn_prefill_fa3 --launch-skip 3 --launch-count 1 $SEC $B/bin/op_bench attnpre > "$OUT/ncu_def.txt" 2>&1; el "ncu default rc=$?"; }
  left 145 && { env $Q PD_CUDA_FA3_DIAG=noload timeout 20 $NCU --clock-control none -k regex:k_attn_prefill_fa3 --launch-skip 3 --launch-count 1 $SEC $B/bin/op_bench_diag attnpre > "$OUT/ncu_noload.txt" 2>&1; el "ncu noload rc=$?"; }
  grep -E "SM Frequency|Compute \(SM\) Throughput|Duration|Memory Throughput|Issue Slots Busy|Shared|Tensor|L1/TEX Hit|L2 Hit|Executed Ipc A" "$OUT/ncu_def.txt" | head -30
fi
el done
