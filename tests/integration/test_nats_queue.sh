#!/bin/sh
# test_nats_queue.sh — the JetStream prefill work queue on loopback (issue 16), the part of
# test_cluster.sh (case 6) that needs no network namespace, so that it runs as any user and under
# `make test-tsan` (the decode worker's enqueue from the engine thread, the prefill workers' fetch
# threads, claims answered on the event loop, libnats' own threads).
#   nats-server (token, JetStream) on a random loopback port; prefill workers p1 and p2 pull from
#   the queue, p1 holds the first job it fetches (--debug-prefill-job-hold-ms, a test hook) and is
#   killed holding it; decode worker d1 (tcp connector, both prefill workers) enqueues every
#   prompt. JetStream redelivers the held job to p2, which claims it: every request completes with
#   the colocated output, every prompt is handed off, none falls back.
# Every wait is bounded; every process started here is stopped on exit.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
pd_need python3 nats-server
. "$here/lib/disagg.sh"
T0=$(date +%s)
dg_token
dg_prompts "$TMP/prompts.json" 12 6 32 96 200
dg_reference both 4 16 --num-kv-blocks 2048
pd_stop both

cat >"$TMP/nats.conf" <<EOF
host: 127.0.0.1
port: -1
authorization { token: "$(cat "$TMP/token")" }
jetstream { store_dir: "$TMP/js", max_memory_store: 64MB, max_file_store: 256MB }
EOF
chmod 600 "$TMP/nats.conf"
nats-server -c "$TMP/nats.conf" >"$TMP/nats.log" 2>&1 &
echo $! >"$TMP/nats.pid"
pd_wait_for 20 grep -q "Server is ready" "$TMP/nats.log" || { cat "$TMP/nats.log" >&2; pd_fail "nats-server did not start"; }
# (port: -1: nats-server picked a free port itself, no port picked here and bound later; it logs it)
NPORT=$(sed -n 's/.*Listening for client connections on 127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$TMP/nats.log" | head -1)
[ -n "$NPORT" ] || { cat "$TMP/nats.log" >&2; pd_fail "nats-server did not log its port"; }
CTL="--control nats://127.0.0.1:$NPORT --prefill-queue"

dg_start_prefill p1 $CTL --debug-prefill-job-hold-ms 600000
KV1=$KV
dg_start_prefill p2 $CTL
KV2=$KV
rm -f "$TMP/d1.out"
pd_start d1 --role decode --prefill "$KV1" --prefill "$KV2" --kv-transport tcp --disagg-min-tokens 16 \
  --disagg-timeout-ms 120000 --num-kv-blocks 2048 --auth-token-file "$TMP/token" --disagg-link-aware off $CTL
URL_d1=$URL
pd_wait_for 30 sh -c "curl -sf '$URL_d1/metrics' | grep -q '^pdserve_kv_prefill_workers_healthy 2'" || pd_fail "d1 did not connect to both"
h0=$(dg_metric "$URL_d1" '^pdserve_kv_handoffs_total'); s0=$(dg_metric "$URL_d1" '^pdserve_kv_local_prefill_short_total')
python3 "$here/disagg_client.py" "$URL_d1" "$TMP/prompts.json" "$TMP/queued.json" --concurrency 4 --max-tokens 16 &
cpid=$!
pd_wait_for 60 grep -q "fetched; holding" "$TMP/p1.err" || { kill $cpid; pd_fail "p1 never fetched a job"; }
held=$(grep -o 'job [0-9a-f]*/[0-9]* fetched' "$TMP/p1.err" | head -1 | awk '{print $2}')
kill -9 "$(cat "$TMP/p1.pid")"; rm -f "$TMP/p1.pid"
echo "p1 killed holding queued job $held"
wait $cpid || pd_fail "queued requests failed"
dg_compare "$TMP/queued.json" "through the JetStream queue, p1 killed holding a job" || pd_fail "queued outputs differ"
grep -q "job $held redelivered" "$TMP/p2.err" || { cat "$TMP/p2.err" >&2; pd_fail "job $held was not redelivered to p2"; }
grep -Eq "job $held (claimed|not queued any more)" "$TMP/p2.err" || { cat "$TMP/p2.err" >&2; pd_fail "p2 did not take job $held"; }
h1=$(dg_metric "$URL_d1" '^pdserve_kv_handoffs_total'); fb=$(dg_metric "$URL_d1" '^pdserve_kv_handoff_fallbacks_total')
s1=$(dg_metric "$URL_d1" '^pdserve_kv_local_prefill_short_total')
echo "job $held redelivered to p2 and taken; $((h1 - h0)) of 12 prompts handed off through the queue," \
  "$((s1 - s0)) under 16 uncached tokens prefilled locally, $fb fallbacks"
[ $((h1 - h0 + s1 - s0)) -eq 12 ] && [ $((h1 - h0)) -ge 6 ] && [ "$fb" -eq 0 ] ||
  pd_fail "expected every prompt of 16+ uncached tokens handed off and no fallback, got $((h1 - h0)) + $((s1 - s0)) short and $fb"
pd_stop d1
pd_stop p2
echo "PASS test_nats_queue ($(( $(date +%s) - T0 )) s)"
