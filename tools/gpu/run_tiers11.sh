#!/bin/sh
# tools/gpu/run_tiers11.sh OUT — session 11 helper "tiers11" (issue 14): the multi-turn chat benchmark
# (bench/kv_tiers_gpu.sh, 384-block pool, 200 conversations x 8 turns, 16 live, max_tokens 1,
# keep-alive client), tiers off and DRAM 16 GiB, same binary, A/B by environment:
#   A   as main (admission: strict FCFS; a tier load reserves only its loaded blocks)
#   B   PDSERVE_SCHED_BACKFILL=1 PDSERVE_TIER_RESERVE=1 (both configurations)
#   R   PDSERVE_TIER_RESERVE=1 alone (DRAM only: it does nothing without tier loads)
# plus tier_bw (host<->device and the tier copy) in the same run. Runs from the repo root of the
# lead's checkout; the folder build/gpu-tiers11 holds bins.tar.xz (pdserve, tier_bw),
# kv_tiers_gpu.sh, kv_tiers_chat.py, llama-3-8b/ (config + kjv tokenizer). ARMS (default "A B R").
set -u
OUT=$1
F=${F:-build/gpu-tiers11}
ARMS=${ARMS:-A B R}
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
arm() {  # arm NAME CASES ENV...
  name=$1 cases=$2; shift 2
  t0=$(date +%s)
  env "$@" BW=0 CHAT_ARGS=--keepalive DEADLINE=30 CASES="$cases" timeout "${ARM_LIMIT:-75}" sh "$D/kv_tiers_gpu.sh" "$OUT/$name" "$D" \
    >"$OUT/$name.log" 2>&1
  echo "== arm $name ($*) rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "TTFT p50|breakdown|server-side|greedy" "$OUT/$name/summary.txt" 2>/dev/null | sed 's/^/  /'
  grep -E "steps ran|device time|KV tier loads|same-step" "$OUT/$name/serve_tail.txt" 2>/dev/null | sed 's/pdserve info: //; s/^/  /'
}
for a in $ARMS; do
  case $a in
    A) arm A "off dram" ;;
    B) arm B "off dram" PDSERVE_SCHED_BACKFILL=1 PDSERVE_TIER_RESERVE=1 ;;
    R) arm R "dram" PDSERVE_TIER_RESERVE=1 ;;
    A2) arm A2 "off dram" ;;
    B2) arm B2 "off dram" PDSERVE_SCHED_BACKFILL=1 PDSERVE_TIER_RESERVE=1 ;;
    *) echo "unknown arm $a" ;;
  esac
done
# Every DRAM run's greedy first tokens against arm A's tiers off (same seed, same dummy weights).
python3 - "$OUT" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
try:
    ref = json.load(open(os.path.join(d, "A", "chat_off.json")))["outputs"]
except Exception as e:
    sys.exit("no reference outputs: %s" % e)
for f in sorted(glob.glob(os.path.join(d, "*", "chat_*.json"))):
    got = json.load(open(f))["outputs"]
    common = [k for k in got if k in ref]
    print("%s: first token identical to A/off in %d of %d" % (os.path.relpath(f, d), sum(got[k] == ref[k] for k in common), len(common)))
PY
rm -rf "$T"
