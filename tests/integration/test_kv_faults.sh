#!/bin/sh
# The KV connector under attack and under faults (issue 13): a prefill worker and a decode worker
# on loopback (CPU), a hostile peer (kv_peer.py) on the prefill worker's KV port. After every case:
# the decode worker's outputs are identical to a colocated server's, its KV pool is back to full
# (pdserve_kv_blocks_used 0) and the counters say what happened.
#   1. unauthenticated HELLO (zero fingerprint), wrong / replayed proofs: closed, nothing learned
#   2. garbage and crafted frames before and after authentication, link probes (PROBE: none before
#      HELLO, sizes over 4 MiB or unaligned close the connection) (oversized bodies, 16 GiB
#      payloads, unknown types, bad versions): the connection closes, the worker lives
#   3. an shm pool announced as 1,000,000 blocks backed by a 4 KB memfd, then block 999,999:
#      refused; tcp blocks outside the announced pool, token ids outside the vocabulary: refused
#   4. 10,000 connect/close cycles (PD_KV_FAULT_CYCLES; the TSan tier runs fewer), then a handoff
#      that must succeed
#   5. a slow-reading peer: /metrics of the prefill worker answers in < 100 ms throughout, the
#      real decode worker's handoffs go on, and the stalled connection is dropped (counted)
#   6. kill -9 of the prefill worker at each protocol step (before HELLO_ACK, mid-slab, before
#      PREFILL_DONE; --debug-kv-pause stops it there)
#   7. an abort storm during transfers
#   8. a seeded (temperature 1) request gives the same text handed off as colocated
#   9. no /dev/shm object appears (pools are memfds), and the router refuses unauthenticated
#      register / deregister, also under `pdserve run`
#  10. a decode pool the prefill worker refuses (--debug-refuse-kv-pool): outputs still right, each
#      prompt counted as a fallback with reason pool_refused (run before 9)
. "$(dirname "$0")/lib/server.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is needed"
here=$(cd "$(dirname "$0")" && pwd)
PEER="python3 $here/kv_peer.py"
. "$(dirname "$0")/lib/disagg.sh"
dg_token
dg_prompts "$TMP/prompts.json" 24 13 17 64 150 250
# The connect/close cycles of case 4: 10,000 in the plain tier; the TSan tier (make test-tsan)
# sets PD_KV_FAULT_CYCLES lower to fit CI's budget (each cycle is a full authenticated handshake,
# ~20x slower under TSan) — the slot recycling it checks is the same at any count above the 256
# slots, which a run of 1,000 passes ~4 times.
CYCLES=${PD_KV_FAULT_CYCLES:-10000}
[ "$CYCLES" -gt 256 ] || pd_fail "PD_KV_FAULT_CYCLES must exceed the 256 connection slots ($CYCLES)"

metric() { dg_metric "$@"; }
compare() { dg_compare "$@"; }
run_clients() {  # run_clients OUT LABEL: the prompts through the decode worker, compared
  python3 "$here/disagg_client.py" "$URL_dec" "$TMP/prompts.json" "$TMP/$1.json" --concurrency 8 --max-tokens 16 ||
    pd_fail "$2: client run failed"
  compare "$TMP/$1.json" "$2" || pd_fail "$2: outputs differ"
  pool_full "$2"
}
pool_full() {
  pd_wait_for 20 sh -c "[ \$(curl -sf '$URL_dec/metrics' | awk '/^pdserve_kv_blocks_used / {print \$2+0}') = 0 ]" ||
    pd_fail "$1: the decode worker's KV pool is not back to full"
}
start_prefill() { dg_start_prefill "$@"; }  # start_prefill NAME [flags]: sets KV, KVPORT, URL
n_dec=0
start_decode() {  # start_decode TRANSPORT (a fresh name each time)
  n_dec=$((n_dec + 1))
  DEC=dec$n_dec
  DG_DECODE_BLOCKS=1024 dg_start_decode $DEC "$1"
  URL_dec=$URL
}
wait_connected() { dg_wait_connected "$URL_dec"; }
shm_before=$(ls /dev/shm 2>/dev/null | grep -c pdserve)

dg_reference both 8 16 --num-kv-blocks 2048

# ---- 1-3: attacks on a live prefill worker (its decode worker keeps serving) ----------------------
start_prefill pf
URL_pf=$URL
start_decode tcp
wait_connected
$PEER unauth_hello 127.0.0.1 "$KVPORT" || pd_fail "unauthenticated HELLO"
$PEER bad_proof 127.0.0.1 "$KVPORT" "$TMP/token" || pd_fail "bad proofs"
$PEER garbage 127.0.0.1 "$KVPORT" "$TMP/token" 40 || pd_fail "garbage frames"
$PEER probe 127.0.0.1 "$KVPORT" "$TMP/token" || pd_fail "link probes"
$PEER big_pool 127.0.0.1 "$KVPORT" "$TMP/token" || pd_fail "oversized shm pool"
$PEER block_range 127.0.0.1 "$KVPORT" "$TMP/token" || pd_fail "block range"
curl -sf "$URL_pf/health" >/dev/null || pd_fail "the prefill worker died under attack"
a=$(metric "$URL_pf" '^pdserve_kv_auth_failures_total')
p=$(metric "$URL_pf" '^pdserve_kv_protocol_errors_total')
r=$(metric "$URL_pf" '^pdserve_kv_peers_refused_total')
[ "$a" -ge 40 ] || pd_fail "auth failures not counted ($a)"
[ "$p" -ge 3 ] || pd_fail "protocol errors not counted ($p)"
[ "$r" -ge 2 ] || pd_fail "refused pools not counted ($r)"
echo "attacks: $a auth failures, $p protocol errors, $r pools refused; the worker is alive"
run_clients attacks "after attacks"
h0=$(metric "$URL_dec" '^pdserve_kv_handoffs_total')
[ "$h0" -ge 24 ] || pd_fail "handoffs did not happen after the attacks ($h0)"

# ---- 4: 10,000 connect/close cycles, then a handoff -----------------------------------------------
$PEER cycles 127.0.0.1 "$KVPORT" "$TMP/token" "$CYCLES" || pd_fail "connect/close cycles"
curl -sf "$URL_pf/health" >/dev/null || pd_fail "the prefill worker died after the cycles"
run_clients cycles "after $CYCLES cycles"
h1=$(metric "$URL_dec" '^pdserve_kv_handoffs_total')
[ "$h1" -ge $((h0 + 24)) ] || pd_fail "no handoff after $CYCLES connect/close cycles ($h0 -> $h1)"
echo "cycles: $((h1 - h0)) handoffs after $CYCLES cycles ($(metric "$URL_pf" '^pdserve_kv_connections_accepted_total') connections accepted)"

# ---- 5: a slow-reading peer -----------------------------------------------------------------------
# Baseline: the worst /metrics latency of the prefill worker while it computes the same client load
# without a slow reader (what this shared, maybe loaded, box gives a busy worker).
worst_metrics() {  # the slowest of 30 GETs of the prefill worker's /metrics, 0.2 s apart (seconds)
  w=0
  for i in $(seq 1 30); do
    t=$(curl -s -o /dev/null -w '%{time_total}' "$URL_pf/metrics")
    w=$(python3 -c "print(max($w, $t))")
    sleep 0.2
  done
  echo "$w"
}
python3 "$here/disagg_client.py" "$URL_dec" "$TMP/prompts.json" "$TMP/base.json" --concurrency 8 --max-tokens 16 &
cpid=$!
base=$(worst_metrics)
wait $cpid || pd_fail "baseline client run failed"
h1=$(metric "$URL_dec" '^pdserve_kv_handoffs_total')
$PEER slow_reader 127.0.0.1 "$KVPORT" "$TMP/token" 25 >"$TMP/slow.out" 2>&1 &
spid=$!
pd_wait_for 20 grep -q 'not reading' "$TMP/slow.out" || pd_fail "slow reader did not start: $(cat "$TMP/slow.out")"
python3 "$here/disagg_client.py" "$URL_dec" "$TMP/prompts.json" "$TMP/slow.json" --concurrency 8 --max-tokens 16 &
cpid=$!
worst=$(worst_metrics)
wait $cpid || pd_fail "client run during the slow reader failed"
compare "$TMP/slow.json" "during a slow reader" || pd_fail "outputs differ during a slow reader"
h2=$(metric "$URL_dec" '^pdserve_kv_handoffs_total')
[ "$h2" -ge $((h1 + 24)) ] || pd_fail "handoffs stopped during a slow reader ($h1 -> $h2)"
# < 100 ms; on a box so loaded that a busy worker's /metrics is slower anyway, no worse than twice
# that baseline (the frozen path this guards against took the whole 10 s write stall)
python3 -c "import sys; sys.exit(0 if $worst < 0.1 or $worst < 2 * $base else 1)" ||
  pd_fail "/metrics took ${worst}s with a slow reader (${base}s without)"
wait $spid
pd_wait_for 30 sh -c "[ \$(curl -sf '$URL_pf/metrics' | awk '/^pdserve_kv_slow_peer_drops_total/ {print \$2+0}') -ge 1 ]" ||
  pd_fail "the stalled connection was not dropped"
pool_full "slow reader"
echo "slow reader: /metrics worst ${worst}s (${base}s under the same load without it), handoffs went on, stalled connection dropped"
pd_stop $DEC
pd_stop pf

# ---- 6: kill -9 of the prefill worker at each protocol step ---------------------------------------
for step in hello_ack mid_slab before_done; do
  for tr in tcp shm; do
    start_prefill pf_${step}_$tr --debug-kv-pause "$step"
    start_decode "$tr"
    if [ "$step" = hello_ack ]; then
      pd_wait_for 30 grep -q "paused at $step" "$TMP/pf_${step}_$tr.err" || pd_fail "$step: the worker did not pause"
      kill -9 "$(cat "$TMP/pf_${step}_$tr.pid")"
      rm -f "$TMP/pf_${step}_$tr.pid"
      run_clients "kill_$step" "kill -9 before HELLO_ACK ($tr)"
    else
      wait_connected
      python3 "$here/disagg_client.py" "$URL_dec" "$TMP/prompts.json" "$TMP/kill_$step.json" --concurrency 8 --max-tokens 16 &
      cpid=$!
      pd_wait_for 30 grep -q "paused at $step" "$TMP/pf_${step}_$tr.err" || pd_fail "$step: the worker did not pause"
      kill -9 "$(cat "$TMP/pf_${step}_$tr.pid")"
      rm -f "$TMP/pf_${step}_$tr.pid"
      wait $cpid || pd_fail "$step: client run failed"
      compare "$TMP/kill_$step.json" "kill -9 at $step ($tr)" || pd_fail "$step: outputs differ"
      pool_full "$step"
      f=$(metric "$URL_dec" 'pdserve_kv_handoff_fallbacks_total.*reason="(worker_died|timeout|unavailable)"')
      [ "$f" -ge 1 ] || pd_fail "$step: no fallback counted"
    fi
    pd_stop $DEC
  done
done
echo "kill -9: before HELLO_ACK, mid-slab and before PREFILL_DONE, tcp and shm: all requests completed"

# ---- 7: abort storm during transfers; 8: seeded sampling ------------------------------------------
start_prefill pf2
start_decode shm
wait_connected
python3 - "$URL_dec" "$TMP/prompts.json" <<'PY'
import json, sys, threading, urllib.request
url, prompts = sys.argv[1], json.load(open(sys.argv[2]))
def go(ids):
    body = json.dumps({"prompt": ids, "max_tokens": 64, "stream": True, "ignore_eos": True}).encode()
    try:
        r = urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body), timeout=10)
        r.read(1)
        r.close()  # the client goes away mid-stream
    except Exception:
        pass
ts = [threading.Thread(target=go, args=(prompts[i % len(prompts)],)) for i in range(96)]
[t.start() for t in ts]
[t.join() for t in ts]
PY
run_clients storm "after an abort storm"
python3 - "$URL_both" "$URL_dec" <<'PY' || pd_fail "seeded sampling differs handed off"
import json, sys, urllib.request
def text(url):
    body = json.dumps({"prompt": "And God said, Let there be light", "max_tokens": 24, "temperature": 1.0, "seed": 4242}).encode()
    return json.loads(urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body), timeout=60).read())["choices"][0]["text"]
a, b = text(sys.argv[1]), text(sys.argv[2])
if a != b:
    sys.exit("FAIL: seeded: colocated %r, handed off %r" % (a, b))
print("seeded: identical handed off and colocated")
PY
pd_stop $DEC
pd_stop pf2

# ---- 10: a decode pool the prefill worker refuses: every prompt prefilled locally, counted ------
start_prefill pf3 --debug-refuse-kv-pool
URL_pf3=$URL
start_decode shm
wait_connected
run_clients refused "refused decode pool"
f=$(metric "$URL_dec" 'pdserve_kv_handoff_fallbacks_total.*reason="pool_refused"')
e=$(metric "$URL_dec" 'pdserve_kv_handoff_fallbacks_total.*reason="error"')
r=$(metric "$URL_pf3" '^pdserve_kv_peers_refused_total')
[ "$f" -ge 24 ] && [ "$e" -eq 0 ] && [ "$r" -ge 1 ] ||
  pd_fail "refused pool: fallbacks pool_refused $f (24 expected), error $e, pools refused $r"
echo "refused pool: $f prompts prefilled locally, counted as reason=\"pool_refused\""
pd_stop $DEC
pd_stop pf3

# ---- 9: no /dev/shm objects; router registration needs the secret ---------------------------------
shm_after=$(ls /dev/shm 2>/dev/null | grep -c pdserve)
[ "$shm_after" -le "$shm_before" ] || pd_fail "a /dev/shm object appeared ($shm_before -> $shm_after)"
reg='{"v":1,"type":"register","url":"http://127.0.0.1:1","role":"decode","model":"kjv-llama-6m","block_size":16}'
"$PD_BIN" router --port 0 --worker "$URL_both" >"$TMP/router.out" 2>"$TMP/router.err" &
echo $! >"$TMP/router.pid"
pd_wait_for 30 grep -q 'http://' "$TMP/router.out" || pd_fail "router did not start"
RURL=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/router.out" | head -1)
code=$(curl -s -o /dev/null -w '%{http_code}' "$RURL/internal/register" -d "$reg")
[ "$code" = 403 ] || pd_fail "a router without a token accepted a registration ($code)"
kill "$(cat "$TMP/router.pid")"
"$PD_BIN" run --model "$MODEL" --port 0 >"$TMP/run.out" 2>"$TMP/run.err" &  # (its router binds a free port, printed)
echo $! >"$TMP/run.pid"
pd_wait_for 120 grep -qi 'serving on' "$TMP/run.out" || pd_fail "pdserve run did not come up: $(tail -5 "$TMP/run.err")"
rport=$(grep -o 'router http://[0-9.]*:[0-9]*' "$TMP/run.out" | head -1 | sed 's/.*://')
[ -n "$rport" ] || pd_fail "pdserve run did not print its router's port"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$rport/internal/register" -d "$reg")
[ "$code" = 401 ] || pd_fail "pdserve run's router accepted an unauthenticated register ($code)"
dereg="{\"v\":1,\"url\":\"$(grep -o 'decode worker http://[0-9.:]*' "$TMP/run.out" | awk '{print $3}')\"}"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$rport/internal/deregister" -d "$dereg")
[ "$code" = 401 ] || pd_fail "pdserve run's router accepted an unauthenticated deregister ($code)"
curl -sf "http://127.0.0.1:$rport/health" >/dev/null || pd_fail "pdserve run's router is unhealthy"
kill -TERM "$(cat "$TMP/run.pid")"
wait "$(cat "$TMP/run.pid")" 2>/dev/null
rm -f "$TMP/run.pid"
echo "router: unauthenticated register / deregister refused (alone: 403, under pdserve run: 401)"
echo "test_kv_faults: all checks passed"
