#!/bin/sh
# test_router.sh — `pdserve router` over real `pdserve serve` workers (the bundled kjv-llama-6m,
# CPU) on 127.0.0.1 with free ports (exit 0 = pass):
#   1. registration: no token / wrong token → 401 (OpenAI error), right token → 200, deregister
#   2. shared-prefix workload: kv routing gives a clearly higher prefix-hit rate (as the workers
#      report it in usage.cached_tokens) than round-robin, and no worker is idle
#   3. /status renders in headless Chromium: the DOM lists every live worker (and a screenshot)
#   4. overload: a burst gets 503 + Retry-After from the router's SLO admission, counted with reason
#      "slo"; refused requests never reach a worker (no timing is judged)
#   5. QoS: premium is never refused while free saturates and is refused
#   6. failover: a worker SIGKILLed mid-stream; every stream completes, gap- and duplicate-free
#      (text equal to an uninterrupted greedy run). Needs the worker's "return_token_ids".
# Needs curl, node, python3 and chromium (make deps installs them).
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
command -v curl >/dev/null || pd_fail "curl is required"
command -v node >/dev/null || pd_fail "node is required"
command -v python3 >/dev/null || pd_fail "python3 is required"
CLIENT="node $here/js/router_client.mjs"

router_start() {  # NAME FLAGS...
  name=$1; shift
  "$PD_BIN" router --host 127.0.0.1 --port 0 "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
  echo $! >"$TMP/$name.pid"
  pd_wait_for 20 grep -q 'http://' "$TMP/$name.out" || { cat "$TMP/$name.err" >&2; pd_fail "router $name did not start"; }
  eval "URL_$name=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/$name.out" | head -1)"
}
router_stop() { kill "$(cat "$TMP/$1.pid")"; wait "$(cat "$TMP/$1.pid")" 2>/dev/null; rm -f "$TMP/$1.pid"; }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

pd_start A --num-kv-blocks 2048
pd_start B --num-kv-blocks 2048
echo "workers: A=$URL_A B=$URL_B"
echo "s3cret-token" >"$TMP/token"

# ---- 1. registration auth ---------------------------------------------------------------------
router_start R --worker "$URL_A" --worker "$URL_B" --auth-token-file "$TMP/token" --routing kv
reg='{"v":1,"type":"register","url":"http://127.0.0.1:1","role":"both","model":"kjv-llama-6m","block_size":16}'
code=$(curl -s -o "$TMP/reg" -w '%{http_code}' "$URL_R/internal/register" -d "$reg")
[ "$code" = 401 ] || pd_fail "register without token: $code"
grep -q '"error":{' "$TMP/reg" || pd_fail "401 body is not an OpenAI error: $(cat "$TMP/reg")"
code=$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer wrong' "$URL_R/internal/register" -d "$reg")
[ "$code" = 401 ] || pd_fail "register with a wrong token: $code"
code=$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer s3cret-token' "$URL_R/internal/deregister" -d '{"v":1,"url":"http://127.0.0.1:1"}')
[ "$code" = 404 ] || pd_fail "deregister of an unknown worker: $code"
code=$(curl -s -o "$TMP/reg" -w '%{http_code}' -H 'Authorization: Bearer s3cret-token' "$URL_R/internal/register" -d "$reg")
[ "$code" = 200 ] || pd_fail "register with the token: $code $(cat "$TMP/reg")"
code=$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer s3cret-token' "$URL_R/internal/deregister" -d '{"v":1,"url":"http://127.0.0.1:1"}')
[ "$code" = 200 ] || pd_fail "deregister: $code"
echo "1. registration auth: ok"

# ---- 2. kv routing vs round-robin --------------------------------------------------------------
# Same workload shape, fresh prefixes per run (a different seed), so neither run inherits cache.
# 96 requests over 32 groups of a 96-token prefix (3 per group; a perfect router hits 2 of 3, 0.615;
# round-robin about 0.42): with 48 over 16 groups one run under ASan landed at kv 0.519 vs 0.423,
# inside the 0.1 margin, from a handful of follow-ups racing their group's first KV events.
kv=$($CLIENT prefix "$URL_R" 96 2 32 101) || pd_fail "kv workload: $kv"
routed=$(curl -s "$URL_R/status.json" | json '" ".join(str(w["routed"]) for w in d["workers"])')
router_start RR --worker "$URL_A" --worker "$URL_B" --routing round-robin
rr=$($CLIENT prefix "$URL_RR" 96 2 32 202) || pd_fail "round-robin workload: $rr"
router_stop RR
hit_kv=$(echo "$kv" | json 'd["hit_rate"]')
hit_rr=$(echo "$rr" | json 'd["hit_rate"]')
echo "2. prefix-hit rate: kv $hit_kv, round-robin $hit_rr; kv routed per worker: $routed"
python3 -c "import sys; sys.exit(0 if $hit_kv >= $hit_rr + 0.1 else 1)" || pd_fail "kv routing is not clearly better"
for n in $routed; do [ "$n" -ge 8 ] || pd_fail "a worker was (nearly) idle under kv routing: $routed"; done
curl -s "$URL_R/metrics" >"$TMP/metrics"
[ "$(pd_metric "$TMP/metrics" 'pdserve_router_routing_decisions_total{policy="kv"}')" -ge 48 ] || pd_fail "decisions not counted"
grep -q '^pdserve_router_prefix_hit_tokens_total [1-9]' "$TMP/metrics" || pd_fail "prefix hits not counted"

# ---- 3. status page in headless chromium ----------------------------------------------------------
command -v chromium >/dev/null || pd_fail "chromium is required (installed by make deps)"
chromium --headless --no-sandbox --disable-gpu --virtual-time-budget=3000 --dump-dom "$URL_R/status" \
  >"$TMP/status.dom" 2>/dev/null || pd_fail "chromium --dump-dom failed"
for u in "$URL_A" "$URL_B"; do grep -q "$u" "$TMP/status.dom" || pd_fail "status page lacks worker $u"; done
grep -q '<polyline\|<svg id="ttft"' "$TMP/status.dom" || pd_fail "status page has no chart"
chromium --headless --no-sandbox --disable-gpu --virtual-time-budget=3000 --window-size=1280,900 \
  --screenshot="$TMP/status.png" "$URL_R/status" >/dev/null 2>&1 || pd_fail "chromium --screenshot failed"
[ -s "$TMP/status.png" ] || pd_fail "empty screenshot"
[ -n "${PD_ROUTER_SCREENSHOT:-}" ] && cp "$TMP/status.png" "$PD_ROUTER_SCREENSHOT"
echo "3. status page: both workers in the DOM, screenshot $(wc -c <"$TMP/status.png") bytes"
router_stop R

# ---- 4. overload: SLO admission refuses at the router, before any worker sees the request -------
# What is checked is the mechanism, never the machine's speed (speed belongs in benchmarks; the
# prediction and the admission rule are unit-tested in test_router_core): under a burst far beyond
# the SLO the router refuses with 503 + Retry-After, every refusal is counted with reason "slo",
# and no refused request reaches a worker (the workers finish exactly the accepted ones). The SLO is
# 2 x the TTFT of a 32-stream burst on this machine (rounded up to a histogram bucket), so a
# 200-stream burst overloads it whatever the CPU.
body='{"prompt":[5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20],"max_tokens":24,"ignore_eos":true,"stream":true}'
router_start C --worker "$URL_A" --worker "$URL_B"
cal=$($CLIENT burst "$URL_C" 32 "$body") || pd_fail "calibration: $cal"
router_stop C
slo=$(echo "$cal" | json 'next((b for b in [250, 500, 1000, 2500, 5000, 10000] if b >= 2 * d["ttft_ms_p50"]), 10000)')
echo "4. calibration (32 streams): $cal -> TTFT SLO $slo ms"
# capacity set high so that the SLO prediction, not the concurrency cap, does the refusing
echo '{"capacity_per_worker":1000}' >"$TMP/cap.json"
router_start O --worker "$URL_A" --worker "$URL_B" --slo-ttft-ms "$slo" --qos-config "$TMP/cap.json"
# warm-up at a moderate load: the router calibrates its TTFT-per-request-in-flight estimate
$CLIENT burst "$URL_O" 8 "$body" >/dev/null || pd_fail "warm-up"
$CLIENT burst "$URL_O" 32 "$body" >/dev/null || pd_fail "warm-up"
workers_done() {  # requests the two workers have finished, every finish reason
  for u in "$URL_A" "$URL_B"; do curl -sf "$u/metrics"; done |
    awk '/^pdserve_request_success_total/ { s += $2 } END { print s + 0 }'
}
router_rejected() {  # REGEX over the router's rejection counters
  curl -sf "$URL_O/metrics" | awk -v re="$1" '$1 ~ re { s += $2 } END { print s + 0 }'
}
done0=$(workers_done); rej0=$(router_rejected '^pdserve_router_rejected_total'); slo0=$(router_rejected 'reason="slo"')
burst=$($CLIENT burst "$URL_O" 200 "$body") || pd_fail "burst client failed: $burst"
echo "   burst: $burst"
ok=$(echo "$burst" | json 'd["ok"]'); rejected=$(echo "$burst" | json 'd["rejected"]')
[ "$ok" -ge 1 ] || pd_fail "nothing accepted"
[ "$rejected" -ge 1 ] || pd_fail "nothing rejected under a 200-request burst"
[ "$(echo "$burst" | json 'sorted(d["statuses"])')" = "[200, 503]" ] || pd_fail "statuses other than 200/503: $burst"
[ "$(echo "$burst" | json 'd["retry_after_all"]')" = True ] || pd_fail "503 without Retry-After"
# Every accepted stream has ended (the client read [DONE]); the workers' counters follow.
served_all() { [ $(( $(workers_done) - done0 )) -ge "$ok" ]; }
pd_wait_for 10 served_all || pd_fail "the workers finished $(( $(workers_done) - done0 )) requests, $ok were accepted"
served=$(( $(workers_done) - done0 ))
[ "$served" = "$ok" ] || pd_fail "workers finished $served requests, the router accepted $ok: refused requests reached a worker"
n=$(( $(router_rejected '^pdserve_router_rejected_total') - rej0 ))
[ "$n" = "$rejected" ] || pd_fail "the router counted $n rejections, the client saw $rejected"
n=$(( $(router_rejected 'reason="slo"') - slo0 ))
[ "$n" = "$rejected" ] || pd_fail "$n of $rejected rejections have reason slo"
echo "   $ok accepted and served, $rejected refused at the router (reason slo, Retry-After), none reached a worker"
router_stop O

# ---- 5. QoS: premium is never refused while free saturates and is refused --------------------------
# Reserved capacity decides, not timing: 2 workers x capacity 4 with half reserved for premium, so
# 2 premium loops always fit and 16 free loops cannot. Latencies are printed, not judged.
cat >"$TMP/qos.json" <<'EOF'
{"classes":[{"name":"premium","priority":2,"reserved_fraction":0.5},
            {"name":"standard","priority":1},
            {"name":"free","priority":0}],
 "capacity_per_worker":4}
EOF
# The guarantee holds over the pool the router counts: the workers in rotation. A worker the router
# takes out of rotation during the load (its polls time out on a loaded machine) halves the pool, and
# premium may then be refused by design; such an attempt proves nothing either way and is run again
# (at most 3). Premium refused while both workers stayed in rotation fails at once.
router_start Q --worker "$URL_A" --worker "$URL_B" --qos-config "$TMP/qos.json"
qbody='{"prompt":[5,6,7,8,9,10,11,12],"max_tokens":16,"ignore_eos":true,"stream":true}'
n_rot() { grep -c 'out of rotation' "$TMP/Q.err" || true; }
qos_clean=0
for attempt in 1 2 3; do
  pd_wait_for 10 sh -c "curl -s $URL_Q/health | grep -q '\"workers_healthy\":2'" || pd_fail "router Q: the workers are not both in rotation"
  rot0=$(n_rot)
  load=$($CLIENT qos "$URL_Q" 6 16 2 "$qbody") || pd_fail "qos load: $load"
  echo "5. qos (attempt $attempt): with a free flood $load"
  if [ "$(n_rot)" != "$rot0" ]; then
    echo "   a worker left rotation during the load (router log: $(grep 'out of rotation' "$TMP/Q.err" | tail -1)): not judged"
    continue
  fi
  qos_clean=1
  break
done
[ "$qos_clean" = 1 ] || pd_fail "a worker left rotation in each of 3 QoS attempts"
[ "$(echo "$load" | json 'd["premium"]["rejected"]')" = 0 ] || pd_fail "premium was refused with both workers in rotation"
[ "$(echo "$load" | json 'd["premium"]["ok"]')" -ge 1 ] || pd_fail "premium was never served"
[ "$(echo "$load" | json 'd["free"]["rejected"]')" -ge 1 ] || pd_fail "free never saturated"
[ "$(echo "$load" | json 'd["free"]["ok"]')" -ge 1 ] || pd_fail "free was never served"
router_stop Q

# ---- 6. failover mid-stream on real workers ------------------------------------------------------------
probe=$(curl -sN "$URL_A/v1/completions" -d '{"prompt":[5,6,7],"max_tokens":2,"stream":true,"return_token_ids":true}')
echo "$probe" | grep -q '"token_ids"' ||
  pd_fail "the worker does not honour \"return_token_ids\" (src/api): mid-stream failover cannot be tested"
router_start F --worker "$URL_A" --worker "$URL_B" --routing round-robin --heartbeat-ms 100
out=$($CLIENT failover "$URL_F" 6 48 "$(cat "$TMP/B.pid")" 30 "$URL_A") || pd_fail "failover: $out"
echo "6. failover: $out"
pd_wait_for 10 sh -c "curl -s $URL_F/health | grep -q '\"workers_healthy\":1'" || pd_fail "dead worker still in rotation"
rm -f "$TMP/B.pid"
echo "test_router: all checks passed"
