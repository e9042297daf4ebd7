#!/bin/sh
# tools/gpu/run_tiers11.sh OUT — session 11 helper "tiers11" (issue 14): the multi-turn chat benchmark
# (bench/kv_tiers_gpu.sh, 384-block pool, 200 conversations x 8 turns, 16 live, max_tokens 1,
# keep-alive client), tiers off and DRAM 16 GiB, same binary, arms by environment (ARMS, in order):
#   P1, P2  tiers off + DRAM, the branch's defaults (a tier load reserves its computed blocks)
#   X       DRAM, PD_CUDA_KV_DMA=1 (tier copies on the copy engines, no SM use)
#   Z       DRAM, PDSERVE_TIER_RESERVE=0 (main's admission: a tier load reserves only its blocks)
#   G       DRAM, PDSERVE_KV_TIER_LAYERWISE=4 (same-step loads copied 4 layers a copy, not 1)
#   K, K16  tiers off + DRAM / DRAM alone, PD_CUDA_KV_COPY_CTAS=32 / 16 (the tier copies' kernel capped
#           at that many CTAs, striding over the copy; tiers off does not use it; 16 is the default
#           from run 3 on, K0 = PD_CUDA_KV_COPY_CTAS=0, one CTA a chunk as before)
#   Q1, Q2  tiers off + DRAM, the defaults (run 3)
#   QJ, J2  tiers off + DRAM / DRAM alone, PDSERVE_KV_TIER_JIT=1 (each layer group's load enqueued
#           when the forward's launch reaches it)
#   A, B, R run 1's arms (main's admission; + backfill + reserve; reserve alone)
# plus tier_bw (host<->device and the tier copy) in the same run. Runs from the repo root of the
# lead's checkout; the folder build/gpu-tiers11 holds bins.tar.xz (pdserve, tier_bw),
# kv_tiers_gpu.sh, kv_tiers_chat.py, llama-3-8b/ (config + kjv tokenizer).
set -u
OUT=$1
F=${F:-build/gpu-tiers11}
ARMS=${ARMS:-Q1 QJ J2}
mkdir -p "$OUT"
T=$(mktemp -d /tmp/t11.XXXXXX)
D=$T/D
mkdir -p "$D"
tar -xJf "$F/bins.tar.xz" -C "$D" || { echo "unpack failed"; exit 1; }
cp "$F/kv_tiers_gpu.sh" "$F/kv_tiers_chat.py" "$D/"
cp -r "$F/llama-3-8b" "$D/"
LIB=${GPULIB:-/tmp/gpulib/lib}
ln -s "$LIB" "$D/lib"
export LD_LIBRARY_PATH="$LIB"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
timeout 40 "$D/tier_bw" 256 >"$OUT/bw.txt" 2>&1
echo "tier_bw rc=$?"; cat "$OUT/bw.txt"
if [ -x "$D/test_backend_ops" ]; then  # the tier copy kernel (and its CTA-capped form) moves the right rows
  timeout 40 "$D/test_backend_ops" kv_xfer_host >"$OUT/ops_kv_xfer_host.txt" 2>&1
  echo "test_backend_ops kv_xfer_host rc=$?: $(tail -1 "$OUT/ops_kv_xfer_host.txt")"
fi
for n in ${BW_CTAS:-0}; do
  PD_CUDA_KV_COPY_CTAS=$n timeout 20 "$D/tier_bw" 256 2>&1 | grep -E "load|offload" | sed "s/^/PD_CUDA_KV_COPY_CTAS=$n /" | tee -a "$OUT/bw.txt"
done
arm() {  # arm NAME CASES ENV...
  name=$1 cases=$2; shift 2
  t0=$(date +%s)
  case $cases in *off*) lim=${ARM_LIMIT:-55} ;; *) lim=${ARM_LIMIT:-26} ;; esac
  env "$@" BW=0 CHAT_ARGS=--keepalive DEADLINE=30 CASES="$cases" timeout "$lim" sh "$D/kv_tiers_gpu.sh" "$OUT/$name" "$D" \
    >"$OUT/$name.log" 2>&1
  echo "== arm $name ($*) rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "TTFT p50|breakdown|server-side|greedy" "$OUT/$name/summary.txt" 2>/dev/null | sed 's/^/  /'
  grep -E "steps ran|device time|KV tier loads|same-step" "$OUT/$name/serve_tail.txt" 2>/dev/null | sed 's/pdserve info: //; s/^/  /'
}
for a in $ARMS; do
  case $a in
    P1 | P2 | P3) arm $a "off dram" ;;
    X) arm X "dram" PD_CUDA_KV_DMA=1 ;;
    Z) arm Z "dram" PDSERVE_TIER_RESERVE=0 ;;
    G) arm G "dram" PDSERVE_KV_TIER_LAYERWISE=4 ;;
    K) arm K "off dram" PD_CUDA_KV_COPY_CTAS=32 ;;
    K16) arm K16 "dram" PD_CUDA_KV_COPY_CTAS=16 ;;
    K0) arm K0 "dram" PD_CUDA_KV_COPY_CTAS=0 ;;
    Q1 | Q2) arm $a "off dram" ;;
    QJ) arm QJ "off dram" PDSERVE_KV_TIER_JIT=1 ;;
    J2) arm J2 "dram" PDSERVE_KV_TIER_JIT=1 ;;
    A) arm A "off dram" PDSERVE_TIER_RESERVE=0 ;;
    B) arm B "off dram" PDSERVE_SCHED_BACKFILL=1 ;;
    R) arm R "dram" ;;
    *) echo "unknown arm $a" ;;
  esac
done
# Every DRAM run's greedy first tokens against arm A's tiers off (same seed, same dummy weights).
python3 - "$OUT" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
offs = sorted(glob.glob(os.path.join(d, "*", "chat_off.json")))
first = os.path.join(d, "Q1", "chat_off.json")
try:
    rf = first if os.path.exists(first) else offs[0]
    ref = json.load(open(rf))["outputs"]
except Exception as e:
    sys.exit("no reference outputs: %s" % e)
print("reference: %s" % os.path.relpath(rf, d))
for f in sorted(glob.glob(os.path.join(d, "*", "chat_*.json"))):
    got = json.load(open(f))["outputs"]
    common = [k for k in got if k in ref]
    print("%s: first token identical to the reference in %d of %d" % (os.path.relpath(f, d), sum(got[k] == ref[k] for k in common), len(common)))
PY
rm -rf "$T"
