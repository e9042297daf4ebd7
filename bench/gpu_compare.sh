#!/bin/sh
# bench/gpu_compare.sh — the standard comparison on a 2-GPU machine (issue: benchmark evidence).
# Llama-3-8B shape with dummy weights, one router in front of:
#   (a) 2 colocated replicas, chunked prefill off
#   (b) 2 colocated replicas, chunked prefill on (512-token chunks)
#   (c) 1 prefill + 1 decode worker, KV over cuda-ipc
# two workloads (prefill-heavy: 20% 7680-token prompts among 512-token ones, 64 output tokens;
# decode-heavy: 256 in, 256 out), a sweep of request rates each. Writes
# OUT/report-{prefill,decode}.html, OUT/svg-{prefill,decode}/*.svg and one JSON per (configuration,
# workload). Prefix caching is off everywhere: every rate of a sweep replays the same seeded prompts,
# and cache hits would make later rates cheaper (and skip handoffs) in every configuration.
# usage: bench/gpu_compare.sh OUT [NUM_PROMPTS]     (PDSERVE=binary, default build/pdserve)
# env: RATES_PREFILL (2,4,8,12), RATES_DECODE (4,8,16,32), WARMUPS (8 per rate), GOODPUT ("ttft:1000
#   tpot:8": an interactive SLO, ~1.7x the unloaded TPOT of this shape on an H200; other SLOs can be
#   applied afterwards with `pdserve bench merge --goodput ...`), WORKLOADS ("prefill decode").
# A CPU dry run of the script itself: CONFIG=models/kjv-llama-6m DEV0=cpu DEV1=cpu TRANSPORT=shm
#   LONG_LEN=1024 SHORT_LEN=128 KV_MEM=256M bench/gpu_compare.sh /tmp/cmp 8
set -eu
out=$1
np=${2:-32}
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${PDSERVE:-$repo/build/pdserve}
. "$repo/bench/lib.sh"
mkdir -p "$out"
model=$(dummy_model "${CONFIG:-bench/configs/llama-3-8b}")
dev0=${DEV0:-cuda:0}; dev1=${DEV1:-cuda:1}; transport=${TRANSPORT:-cuda-ipc}
long=${LONG_LEN:-7680}; short=${SHORT_LEN:-512}
pids=""
cleanup() { for p in $pids; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
serve() {  # serve LOG FLAGS... ; sets $url
  log=$1; shift
  p=$(free_port)
  "$bin" serve --model "$model" --load-format dummy --port "$p" --kv-cache-memory ${KV_MEM:-24G} --no-prefix-caching "$@" >"$out/$log.log" 2>&1 &
  pids="$pids $!"
  url="http://127.0.0.1:$p"
  wait_health "$url"
}
router() {  # router FLAGS... ; sets $rurl
  p=$(free_port)
  "$bin" router --port "$p" "$@" >"$out/router.log" 2>&1 &
  pids="$pids $!"
  rurl="http://127.0.0.1:$p"
  wait_health "$rurl"
}
bench() {  # bench LABEL TAG FLAGS...
  label=$1; tag=$2; shift 2
  "$bin" bench --url "$rurl" --label "$label" --output-json "$out/$tag.json" --num-prompts "$np" --seed 1 \
    --goodput ${GOODPUT:-ttft:1000 tpot:8} --max-concurrency 64 --num-warmups ${WARMUPS:-8} --quiet --return-token-ids "$@" | tee "$out/$tag.txt"
}
run_workloads() {  # run_workloads LABEL TAG   (WORKLOADS="prefill decode" by default)
  for w in ${WORKLOADS:-prefill decode}; do
    case $w in
    prefill) bench "$1" "$2-prefill" --dataset long-mix --long-fraction 0.2 --long-len $long --short-len $short \
               --output-len 64 --sweep-rates ${RATES_PREFILL:-2,4,8,12} ;;
    decode) bench "$1" "$2-decode" --dataset random --input-len 256 --output-len 256 --sweep-rates ${RATES_DECODE:-4,8,16,32} ;;
    esac
  done
}

for cfg in a b c; do
  pids_before=$pids
  case $cfg in
  a) serve a0 --device $dev0 --no-chunked-prefill --max-num-batched-tokens 8192; u0=$url
     serve a1 --device $dev1 --no-chunked-prefill --max-num-batched-tokens 8192; u1=$url
     router --worker "$u0" --worker "$u1"; label="(a) 2 colocated, no chunking" ;;
  b) serve b0 --device $dev0 --max-num-batched-tokens 512; u0=$url
     serve b1 --device $dev1 --max-num-batched-tokens 512; u1=$url
     router --worker "$u0" --worker "$u1"; label="(b) 2 colocated, chunked 512" ;;
  c) kv=$(free_port)
     serve c_prefill --device $dev0 --role prefill --kv-port "$kv" --max-num-batched-tokens 8192; up=$url
     serve c_decode --device $dev1 --role decode --prefill "127.0.0.1:$kv" --kv-transport $transport; ud=$url
     router --decode "$ud" --prefill "$up"; label="(c) 1 prefill + 1 decode, $transport" ;;
  esac
  run_workloads "$label" "$cfg"
  [ "$cfg" = c ] && curl -sf "$ud/metrics" | grep -E '^pdserve_kv_handoff' > "$out/c_handoff_metrics.txt" || true
  cleanup
  pids=""
done
for w in ${WORKLOADS:-prefill decode}; do
  "$bin" bench merge --output-html "$out/report-$w.html" --output-svg-dir "$out/svg-$w" \
    "$out/a-$w.json" "$out/b-$w.json" "$out/c-$w.json"
done
echo "reports in $out"
