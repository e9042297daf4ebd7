#!/bin/sh
# test_nats_faults.sh — the NATS control plane under attack (issue 16), on loopback: nats-server
# (token auth, JetStream) on a random port, a prefill worker and a decode worker (tcp connector,
# the JetStream prefill queue) and the router, all with --control. A hostile client
# (nats_peer.py: the NATS text protocol; it holds the NATS token, and for some messages even the
# signing secret) publishes on every subject the router and the workers subscribe to. After every
# phase: the router's completions (handed off through the queue) are identical to a colocated
# server's, every process is alive, the router's worker table holds exactly the two real workers
# (no fake worker got a slot or a request), and the counters say what was refused.
#   1. nats-server refuses a client without the token or with a wrong one; so is a worker
#   2. garbage on every subject: non-JSON, truncated, wrong types, deep nesting, numbers out of
#      range, duplicate keys, max_payload-sized bodies — unsigned, with a forged MAC, and signed
#   3. crafted presences: every field wrong once, URLs that are not addresses, unknown roles,
#      spoofed instance ids (a fake id at the real url; the real id at a fake url, also "leaving"),
#      a fake worker at a dead address, negative and huge load numbers
#   4. 2000 distinct fake workers (the 64-slot table): none admitted, the real two stay
#   5. a real presence captured and replayed, and tampered into a "leaving": refused; then a
#      signed one with 3002 hostile KV events and out-of-range load: applied but bounded (no
#      negative load), and the router resyncs with the real worker
#   6. resync requests: unsigned (no answer), malformed (no answer), a burst (rate-limited)
#   7. claims from addresses the decode worker does not dial (refused: nothing is sent there),
#      malformed claims, an unsigned claim (no answer)
#   8. hostile jobs on the JetStream prefill queue (unsigned, malformed, bogus decode ids,
#      duplicates): dropped or answered "gone", real jobs still flow
#   9. nkey authentication: nats-server with nkey users (keys from `pdserve nkey-gen`): the router
#      and a worker with their seeds are admitted and serve; a worker with a wrong seed, with none
#      (token instead) or with a seed file others may read is not admitted
# Every loop is bounded; every process started here is stopped on exit.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
pd_need python3 nats-server
. "$here/lib/disagg.sh"
T0=$(date +%s)
PEER="python3 $here/nats_peer.py"
dg_token
dg_prompts "$TMP/prompts.json" 16 16 20 64 150
dg_reference both 8 16 --num-kv-blocks 2048
pd_stop both

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
DEAD=$(free_port)  # nothing listens here
# nats-server picks its own free port (port: -1) and logs it: no port picked here and bound later
nats_port() { sed -n 's/.*Listening for client connections on 127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$1" | head -1; }
cat >"$TMP/nats.conf" <<EOF
host: 127.0.0.1
port: -1
max_payload: 1048576
authorization { token: "$(cat "$TMP/token")" }
jetstream { store_dir: "$TMP/js", max_memory_store: 64MB, max_file_store: 256MB }
EOF
chmod 600 "$TMP/nats.conf"
nats-server -c "$TMP/nats.conf" >"$TMP/nats.log" 2>&1 &
echo $! >"$TMP/nats.pid"
pd_wait_for 20 grep -q "Server is ready" "$TMP/nats.log" || { cat "$TMP/nats.log" >&2; pd_fail "nats-server did not start"; }
NPORT=$(nats_port "$TMP/nats.log")
[ -n "$NPORT" ] || { cat "$TMP/nats.log" >&2; pd_fail "nats-server did not log its port"; }
NATS="nats://127.0.0.1:$NPORT"
CTL="--control $NATS --control-heartbeat-ms 200"

# ---- 1. authentication ----
$PEER auth --port "$NPORT" --token-file "$TMP/token" || pd_fail "NATS authentication"
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/wrong")
if timeout 60 "$PD_BIN" serve --model "$MODEL" --port 0 --role decode --prefill 127.0.0.1:1 --auth-token-file "$TMP/wrong" \
    $CTL >"$TMP/wrong.out" 2>"$TMP/wrong.err"; then
  pd_fail "a worker with the wrong token started"
fi
grep -q "Authorization Violation" "$TMP/wrong.err" || { cat "$TMP/wrong.err" >&2; pd_fail "the wrong token's refusal is not named"; }
if grep -E "Sanitizer|runtime error" "$TMP/wrong.err"; then pd_fail "the refused worker: sanitizer report on its way out"; fi
echo "ok   1. a worker with the wrong token is refused by nats-server and exits"

# ---- the cluster ----
dg_start_prefill p1 $CTL --prefill-queue
dg_start_decode d1 tcp $CTL --prefill-queue --disagg-link-aware off
URL_d1=$URL
dg_wait_connected "$URL_d1"
"$PD_BIN" router --port 0 --auth-token-file "$TMP/token" --control "$NATS" >"$TMP/rt.out" 2>"$TMP/rt.err" &
echo $! >"$TMP/rt.pid"
pd_wait_for 30 grep -q 'http://' "$TMP/rt.out" || { cat "$TMP/rt.err" >&2; pd_fail "the router did not start"; }
URL_rt=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/rt.out" | head -1)
inst_of() { curl -sf "$1/internal/state?since=0" | python3 -c 'import json,sys; print(json.load(sys.stdin)["instance"])'; }
DEC=$(inst_of "$URL_d1"); PRE=$(inst_of "$URL_p1")
[ -n "$DEC" ] && [ -n "$PRE" ] || pd_fail "no instance ids"
workers() {  # the router's worker table: "url state" lines, sorted
  curl -sf "$URL_rt/status.json" | python3 -c '
import json, sys
for w in sorted(json.load(sys.stdin)["workers"], key=lambda w: w["url"]): print(w["url"], w["state"])'
}
pd_wait_for 30 sh -c "[ \$(curl -sf '$URL_rt/status.json' | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"workers_healthy\"])') = 2 ]" ||
  { workers; cat "$TMP/rt.err" >&2; pd_fail "the router did not find both workers through NATS"; }
EXPECT=$(printf '%s\n%s\n' "$URL_d1" "$URL_p1" | sort | tr '\n' ' ')
rejected() { curl -sf "$URL_rt/metrics" | awk -v r="reason=\"$1\"" 'index($0, "pdserve_router_nats_rejected_total{" r "}") == 1 {print $2+0}'; }
rmetric() { curl -sf "$URL_rt/metrics" | awk -v n="$1" '$1 == n {print $2+0}'; }
n_check=0
check() {  # check LABEL: everything still right after a phase
  n_check=$((n_check + 1))
  for p in nats p1 d1 rt; do kill -0 "$(cat "$TMP/$p.pid")" 2>/dev/null || pd_fail "$1: $p died"; done
  h0=$(dg_metric "$URL_d1" '^pdserve_kv_handoffs_total')
  python3 "$here/disagg_client.py" "$URL_rt" "$TMP/prompts.json" "$TMP/out$n_check.json" --concurrency 8 --max-tokens 16 ||
    pd_fail "$1: client run through the router failed"
  dg_compare "$TMP/out$n_check.json" "$1: through the router" || pd_fail "$1: outputs differ"
  h1=$(dg_metric "$URL_d1" '^pdserve_kv_handoffs_total')
  [ $((h1 - h0)) -ge 1 ] || pd_fail "$1: no prompt was handed off through the JetStream queue"
  got=$(workers | awk '{print $1}' | tr '\n' ' ')
  [ "$got" = "$EXPECT" ] || { workers; pd_fail "$1: the router's workers are [$got], not [$EXPECT]"; }
  workers | grep -qv ' up$' && { workers; pd_fail "$1: a real worker is out of rotation"; }
  echo "     $((h1 - h0)) of 16 handed off through the queue; the router lists exactly the two real workers"
}
check "0. baseline"
PA="--port $NPORT --token-file $TMP/token --dec-inst $DEC --pre-inst $PRE --dec-url $URL_d1 --dead-port $DEAD"

# ---- 2. garbage on every subject ----
$PEER garbage $PA || pd_fail "garbage phase"
check "2. garbage on every subject"
bm=$(rmetric pdserve_router_nats_bad_mac)
[ "$bm" -ge 1 ] || pd_fail "the router counted no message without a valid MAC"
for r in bad_json bad_subject; do [ "$(rejected $r)" -ge 1 ] || pd_fail "no presence rejected as $r"; done
echo "     router: $bm unsigned/forged dropped, $(rejected bad_json) bad_json, $(rejected bad_subject) bad_subject, $(rejected unsolicited) unsolicited"

# ---- 3. crafted presences ----
v0=$(rejected verify_failed)
$PEER presence $PA || pd_fail "presence phase"
# three fakes reach the address check: at a dead address, at the real decode worker's url (another
# instance answers there), with a negative load (dead address): each refused. The checks run in
# the background (a dial each): wait for the three refusals (bounded) before the worker table is
# judged, so that no check is still pending when it is.
verified3() { [ $(( $(rejected verify_failed) - v0 )) -ge 3 ]; }
pd_wait_for 30 verified3 || pd_fail "the fake workers were not refused by the address check ($(( $(rejected verify_failed) - v0 )) of 3)"
check "3. crafted presences"
for r in bad_field bad_subject spoofed verify_failed; do [ "$(rejected $r)" -ge 1 ] || pd_fail "no presence rejected as $r"; done
echo "     router: $(rejected bad_field) bad_field, $(rejected spoofed) spoofed, $(( $(rejected verify_failed) - v0 )) failed the address check"

# ---- 4. thousands of fake workers ----
v0=$(rejected verify_failed); f0=$(rejected pending_full); b0=$(rmetric pdserve_router_nats_bad_mac)
$PEER flood $PA --n 2000 || pd_fail "flood phase"
flood_counts() { nf=$(( $(rejected verify_failed) - v0 + $(rejected pending_full) - f0 )); nb=$(( $(rmetric pdserve_router_nats_bad_mac) - b0 )); }
flood_refused() { flood_counts; [ "$nf" -ge 900 ] && [ "$nb" -ge 900 ]; }
# (the signed fakes' address checks finish in the background: waited for, bounded, before the table is judged)
pd_wait_for 30 flood_refused; flood_counts
[ "$nf" -ge 900 ] && [ "$nb" -ge 900 ] || pd_fail "the flood was not refused and counted ($nf refused, $nb unsigned)"
check "4. 2000 fake workers"
[ "$(rmetric pdserve_router_nats_workers_verified)" -le 4 ] || pd_fail "more workers admitted than the real ones"
echo "     router: $nb unsigned dropped, $nf signed fakes refused (address check / too many at once); $(grep -c 'refused' "$TMP/rt.err") log lines in all"

# ---- 5. replay ----
# The router keeps one resync per worker outstanding for 1 s (ask_resync): let any from earlier
# phases lapse, so the hostile events' resync is asked for and counted.
sleep 1.2
r0=$(rejected replayed); y0=$(rmetric pdserve_router_nats_resyncs)
$PEER replay $PA || pd_fail "replay phase"
check "5. replayed presences, hostile KV events"
[ $(( $(rejected replayed) - r0 )) -ge 3 ] || pd_fail "the replays were not refused ($(( $(rejected replayed) - r0 )))"
i=0
while [ $(( $(rmetric pdserve_router_nats_resyncs) - y0 )) -lt 1 ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done  # bounded: 5 s
[ $(( $(rmetric pdserve_router_nats_resyncs) - y0 )) -ge 1 ] || pd_fail "the router did not resync after the hostile events"
curl -sf "$URL_rt/status.json" | python3 -c '
import json, sys
for w in json.load(sys.stdin)["workers"]:
    assert w["running"] >= 0 and w["waiting"] >= 0, w' || pd_fail "a negative load reached the router's table"
echo "     router: $(( $(rejected replayed) - r0 )) replays refused; resynced after the hostile events; no negative load"

# ---- 6. resync ----
$PEER resync $PA || pd_fail "resync phase"
grep -q "resync request refused" "$TMP/d1.err" || pd_fail "the decode worker did not log refused resyncs"
check "6. resync requests"

# ---- 7. claims ----
$PEER claim $PA || pd_fail "claim phase"
grep -q "prefill claim refused: an address this worker does not dial" "$TMP/d1.err" || pd_fail "the refused claim is not logged"
check "7. hostile claims"

# ---- 8. jobs ----
$PEER jobs $PA || pd_fail "jobs phase"
pd_wait_for 20 grep -q "malformed prefill job dropped" "$TMP/p1.err" || pd_fail "the prefill worker did not drop malformed jobs"
check "8. hostile jobs on the JetStream queue"
grep -q "job 0000000000000bad/7 not queued any more" "$TMP/p1.err" || pd_fail "the bogus decode id's job was not dropped"
if grep -E "pdserve.claim.(\.\./|pdserve)" "$TMP/p1.err"; then pd_fail "a job's decode id reached a subject"; fi
grep -q "NATS messages without a valid signature" "$TMP/p1.err" && grep -q "NATS messages without a valid signature" "$TMP/d1.err" ||
  pd_fail "the workers did not log the unsigned messages they dropped"
echo "     prefill worker: $(grep -c 'malformed prefill job dropped' "$TMP/p1.err") malformed jobs dropped;" \
  "$(grep 'without a valid signature' "$TMP/p1.err" | tail -1 | grep -o '[0-9]* NATS' | head -1) unsigned dropped"
for f in rt p1 d1; do
  if grep -E "AddressSanitizer|ThreadSanitizer|runtime error|Assertion" "$TMP/$f.err"; then pd_fail "$f: sanitizer or assertion report"; fi
done
for n in rt d1 p1; do kill -TERM "$(cat "$TMP/$n.pid")"; done
for n in rt d1 p1; do
  p=$(cat "$TMP/$n.pid"); i=0
  while kill -0 "$p" 2>/dev/null && [ $i -lt $((300 * ${PD_TEST_TIME_SCALE:-1})) ]; do sleep 0.1; i=$((i+1)); done
  wait "$p" || pd_fail "$n exited with a failure status after the attack"
  rm -f "$TMP/$n.pid"
done
echo "ok   router and workers shut down cleanly (exit 0)"

# ---- 9. nkey authentication ----
"$PD_BIN" nkey-gen --out "$TMP/rt.seed" >"$TMP/rt.pub" || pd_fail "nkey-gen"
"$PD_BIN" nkey-gen --out "$TMP/w.seed" >"$TMP/w.pub" || pd_fail "nkey-gen"
"$PD_BIN" nkey-gen --out "$TMP/other.seed" >/dev/null || pd_fail "nkey-gen"
[ "$("$PD_BIN" nkey-gen --public-of "$TMP/w.seed")" = "$(cat "$TMP/w.pub")" ] || pd_fail "--public-of differs"
if "$PD_BIN" nkey-gen --out "$TMP/w.seed" >/dev/null 2>&1; then pd_fail "nkey-gen overwrote a seed"; fi
[ "$(stat -c %a "$TMP/w.seed")" = 600 ] || pd_fail "the seed file is not 0600"
grep -Eq '^SU[A-Z2-7]{56}$' "$TMP/w.seed" && grep -Eq '^U[A-Z2-7]{55}$' "$TMP/w.pub" || pd_fail "not nkeys text"
cat >"$TMP/nkey.conf" <<EOF
host: 127.0.0.1
port: -1
authorization { users = [ { nkey: $(cat "$TMP/rt.pub") }, { nkey: $(cat "$TMP/w.pub") } ] }
EOF
nats-server -c "$TMP/nkey.conf" >"$TMP/nats2.log" 2>&1 &
echo $! >"$TMP/nats2.pid"
pd_wait_for 20 grep -q "Server is ready" "$TMP/nats2.log" || { cat "$TMP/nats2.log" >&2; pd_fail "nats-server (nkey) did not start"; }
NPORT2=$(nats_port "$TMP/nats2.log")
[ -n "$NPORT2" ] || { cat "$TMP/nats2.log" >&2; pd_fail "nats-server (nkey) did not log its port"; }
NK="--control nats://127.0.0.1:$NPORT2"
refused() {  # refused LABEL ARGS...: the worker must not start, and say why
  what=$1; shift
  if timeout 60 "$PD_BIN" serve --model "$MODEL" --port 0 --auth-token-file "$TMP/token" $NK "$@" >"$TMP/nk.out" 2>"$TMP/nk.err"; then
    pd_fail "a worker with $what started"
  fi
  grep -Eq "$REASON" "$TMP/nk.err" || { cat "$TMP/nk.err" >&2; pd_fail "a worker with $what: the reason is not named"; }
  if grep -E "Sanitizer|runtime error" "$TMP/nk.err"; then pd_fail "a worker with $what: sanitizer report on its way out"; fi
  echo "ok   9. a worker with $what is not admitted ($(grep -Eo "$REASON" "$TMP/nk.err" | head -1))"
}
REASON="Authorization Violation"
refused "another nkey's seed" --control-nkey-seed "$TMP/other.seed"
refused "no seed (the token instead)"
cp "$TMP/w.seed" "$TMP/open.seed"; chmod 644 "$TMP/open.seed"
REASON="readable by group or others"
refused "a seed file others may read" --control-nkey-seed "$TMP/open.seed"
(umask 077; sed 's/^SU\(.\)/SU\1/; s/.$/A/' "$TMP/w.seed" >"$TMP/typo.seed")
cmp -s "$TMP/typo.seed" "$TMP/w.seed" && (umask 077; sed 's/.$/B/' "$TMP/w.seed" >"$TMP/typo.seed")
REASON="checksum|not base32"
refused "a seed with a typo" --control-nkey-seed "$TMP/typo.seed"
"$PD_BIN" router --port 0 --auth-token-file "$TMP/token" $NK --control-nkey-seed "$TMP/rt.seed" >"$TMP/rt2.out" 2>"$TMP/rt2.err" &
echo $! >"$TMP/rt2.pid"
pd_wait_for 30 grep -q 'http://' "$TMP/rt2.out" || { cat "$TMP/rt2.err" >&2; pd_fail "the router (nkey) did not start"; }
URL_rt2=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/rt2.out" | head -1)
pd_start nkw --num-kv-blocks 2048 --auth-token-file "$TMP/token" $NK --control-nkey-seed "$TMP/w.seed"
pd_wait_for 30 sh -c "curl -sf '$URL_rt2/health' | grep -q '\"decode_workers_healthy\": *1'" ||
  { cat "$TMP/rt2.err" >&2; pd_fail "the router (nkey) did not admit the worker with its seed"; }
python3 "$here/disagg_client.py" "$URL_rt2" "$TMP/prompts.json" "$TMP/nkey.json" --concurrency 8 --max-tokens 16 ||
  pd_fail "requests through the nkey cluster failed"
dg_compare "$TMP/nkey.json" "9. nkey-authenticated router + worker" || pd_fail "nkey cluster outputs differ"
pd_stop nkw
pd_stop rt2
echo "PASS test_nats_faults ($(( $(date +%s) - T0 )) s)"
