#!/bin/sh
# bench_kv_transports.sh — KV connector throughput, tcp against ucx (UCX_TLS=tcp,self), on the
# loopback and across a veth pair between two network namespaces (unshaped), CPU pools.
# A prefill and a decode worker (kjv-llama-6m, f32 KV: 6144 bytes a token); the prefill worker
# ships every layer after the forward pass (PD_KV_OVERLAP=0), so the decode worker's TTFT part
# "transfer" is the KV's own time on the wire (request → verified KV, minus the prefill worker's
# queue and compute). N fresh prompts of L tokens, one at a time. Prints MB/s per transport and path.
# Needs root for the veth part (skipped otherwise). Usage: sh tools/bench_kv_transports.sh [N] [L]
set -u
N=${1:-12}; L=${2:-1500}
repo=$(cd "$(dirname "$0")/.." && pwd)
BIN=$repo/build/pdserve; MODEL=$repo/models/kjv-llama-6m
[ -e "$MODEL/config.json" ] || MODEL=$repo/../shared/models/kjv-llama-6m
TMP=$(mktemp -d); NA="pdkb$$a"; NB="pdkb$$b"
pids=""
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null; done
  sleep 1; for p in $pids; do kill -9 "$p" 2>/dev/null; done
  ip netns del "$NA" 2>/dev/null; ip netns del "$NB" 2>/dev/null; rm -rf "$TMP"
}
trap cleanup EXIT
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/token")
export OMP_NUM_THREADS=1 UCX_TLS=tcp,self
run() {  # run PATH TRANSPORT PREFIX_A PREFIX_B HOST_A HOST_B
  path=$1; tr=$2; ea=$3; eb=$4; ha=$5; hb=$6
  PD_KV_OVERLAP=0 $ea "$BIN" serve --model "$MODEL" --host "$ha" --port 0 --role prefill --kv-host "$ha" --kv-port 0 \
    --num-kv-blocks 1024 --auth-token-file "$TMP/token" >"$TMP/p.out" 2>"$TMP/p.err" &
  pp=$!; pids="$pids $pp"
  i=0; while ! grep -qs 'http://' "$TMP/p.out" && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
  kv=$(grep -o 'KV port [0-9.]*:[0-9]*' "$TMP/p.out" | awk '{print $3}')
  $eb "$BIN" serve --model "$MODEL" --host "$hb" --port 0 --role decode --prefill "$kv" --kv-transport "$tr" \
    --disagg-min-tokens 1 --num-kv-blocks 1024 --auth-token-file "$TMP/token" >"$TMP/d.out" 2>"$TMP/d.err" &
  dp=$!; pids="$pids $dp"
  i=0; while ! grep -qs 'http://' "$TMP/d.out" && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
  u=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/d.out" | head -1)
  [ -n "$u" ] || { echo "decode worker did not start:"; tail -5 "$TMP/d.err"; kill $dp $pp 2>/dev/null; wait $dp $pp 2>/dev/null; return; }
  i=0; until $eb curl -sf "$u/metrics" | grep -q '^pdserve_kv_prefill_workers_healthy 1' || [ $i -ge 300 ]; do sleep 0.1; i=$((i+1)); done
  $eb python3 - "$u" "$N" "$L" <<'PY'
import json, random, sys, urllib.request
u, n, l = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = random.Random(5)
for k in range(n + 1):  # the first one warms up (not counted: the state is read before and after)
    if k == 1: s0 = json.load(urllib.request.urlopen(u + "/internal/state?since=0"))["load"]
    body = json.dumps({"prompt": [r.randrange(10, 4000) for _ in range(l)], "max_tokens": 1, "temperature": 0}).encode()
    urllib.request.urlopen(urllib.request.Request(u + "/v1/completions", data=body, headers={"Content-Type": "application/json"}), timeout=300).read()
s1 = json.load(urllib.request.urlopen(u + "/internal/state?since=0"))["load"]
d = lambda k: s1["disagg"][k] - s0["disagg"][k]
tr_ms = s1["ttft"]["transfer_ms"] - s0["ttft"]["transfer_ms"]
print("%d handoffs, %.1f MB, transfer %.1f ms in all: %.0f MB/s" % (
    d("handoffs"), d("handoff_bytes") / 1e6, tr_ms, d("handoff_bytes") / 1e6 / (tr_ms / 1e3)))
PY
  kill $dp $pp 2>/dev/null; wait $dp $pp 2>/dev/null
}
for tr in ${TRANSPORTS:-tcp ucx}; do printf "loopback %-4s " $tr; run loopback $tr "" "" 127.0.0.1 127.0.0.1; done
if [ "$(id -u)" = 0 ] && ip netns add "$NA" 2>/dev/null; then
  ip netns add "$NB"; ip link add "$NA" type veth peer name "$NB"
  ip link set "$NA" netns "$NA"; ip link set "$NB" netns "$NB"
  ip -n "$NA" addr add 10.233.7.1/24 dev "$NA"; ip -n "$NB" addr add 10.233.7.2/24 dev "$NB"
  for n in "$NA" "$NB"; do ip -n "$n" link set lo up; ip -n "$n" link set "$n" up; done
  for tr in ${TRANSPORTS:-tcp ucx}; do printf "veth     %-4s " $tr; run veth $tr "ip netns exec $NA" "ip netns exec $NB" 10.233.7.1 10.233.7.2; done
else
  echo "veth: skipped (needs root and network namespaces)"
fi
