#!/bin/sh
# bench/kv_tiers_cpu.sh [BIN] — the time to first token of a 1024-token prompt (kjv-llama-6m, cpu
# backend, one thread) when its KV is computed, loaded from host DRAM, from the local disk tier
# and from the Redis pool (issue 14). Each case: 5 requests (max_tokens 1, so the latency is the
# TTFT plus one sampling), the median printed, with the tier's own per-block load time from
# /metrics. The device pool holds 80 blocks: two other 1024-token prompts push the prompt out of
# it between repetitions, so every repetition is a tier hit (or a recompute with tiers off).
set -e
repo=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$repo/build/pdserve}
MODEL=$repo/models/kjv-llama-6m
[ -e "$MODEL/config.json" ] || MODEL=$repo/../shared/models/kjv-llama-6m
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
T=$(mktemp -d)
cleanup() {
  for f in "$T"/*.pid; do
    if [ -e "$f" ]; then kill "$(cat "$f")" 2>/dev/null || true; fi
  done
  sleep 0.5
  rm -rf "$T"
}
trap cleanup EXIT INT TERM
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$T/token"; chmod 600 "$T/token"
RPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$RPORT" --bind 127.0.0.1 --save '' --appendonly no --requirepass "$(cat "$T/token")" >/dev/null 2>&1 &
echo $! >"$T/redis-server.pid"
sleep 0.5

start() {  # start NAME FLAGS...: sets URL
  n=$1; shift
  "$BIN" serve --model "$MODEL" --port 0 --num-kv-blocks 80 --auth-token-file "$T/token" "$@" >"$T/$n.out" 2>"$T/$n.err" &
  echo $! >"$T/$n.pid"
  for i in $(seq 1 300); do grep -q 'http://' "$T/$n.out" 2>/dev/null && break; sleep 0.1; done
  URL=$(grep -o 'http://[0-9.]*:[0-9]*' "$T/$n.out" | head -1)
  for i in $(seq 1 300); do curl -sf "$URL/health" >/dev/null && break; sleep 0.1; done
}
stop() { kill "$(cat "$T/$1.pid")"; wait "$(cat "$T/$1.pid")" 2>/dev/null || true; rm -f "$T/$1.pid"; }

# measure LABEL WARM: WARM=1 computes the prompt once first (it reaches the tiers)
measure() {
  python3 - "$URL" "$1" "$2" <<'PY'
import json, random, statistics, sys, time, urllib.request
url, label, warm = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
rng = random.Random(7)
a, b, c = ([rng.randrange(10, 4000) for _ in range(1025)] for _ in range(3))
def req(ids):
    body = json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    t = time.perf_counter()
    urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body,
                           headers={"Content-Type": "application/json"}), timeout=120).read()
    return (time.perf_counter() - t) * 1000
if warm:
    req(a)
ts = []
for _ in range(5):
    req(b); req(c)           # push a out of the device pool
    ts.append(req(a))
m = urllib.request.urlopen(url + "/metrics").read().decode()
def val(name):
    return sum(float(l.split()[-1]) for l in m.splitlines() if l.startswith(name))
n, s = val("pdserve_kv_tier_load_seconds_count"), val("pdserve_kv_tier_load_seconds_sum")
per_block = "%.3f ms" % (s / n * 1000) if n else "-"
print("%-28s TTFT median %7.1f ms (min %6.1f, max %6.1f)  tier hit tokens %6d  load per block %s" %
      (label, statistics.median(ts), min(ts), max(ts), val("pdserve_kv_tier_hit_tokens_total"), per_block))
PY
}

start off;   measure "tiers off (recompute)" 0; stop off
start dram --kv-offload-dram 64M; measure "DRAM tier" 1; stop dram
start disk --kv-offload-disk "$T/disk" --kv-offload-disk-size 256M; measure "disk tier (fills it)" 1; stop disk
start disk2 --kv-offload-disk "$T/disk" --kv-offload-disk-size 256M; measure "disk tier (after a restart)" 0; stop disk2
start pool --kv-remote "redis://127.0.0.1:$RPORT"; measure "Redis pool" 1; stop pool
start pool2 --kv-remote "redis://127.0.0.1:$RPORT" --kv-offload-dtype int8; measure "Redis pool, int8 pages" 1; stop pool2
kill "$(cat "$T/redis-server.pid")"; wait "$(cat "$T/redis-server.pid")" 2>/dev/null || true; rm -f "$T/redis-server.pid"
