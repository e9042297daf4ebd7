#!/bin/sh
# test_router_ops.sh — the router as operators meet it (issue 18), on the bundled kjv-llama-6m
# (CPU), every server on a free loopback port (exit 0 = pass):
#   1. a 300-request streaming burst through `pdserve run` (prefill, decode and router processes):
#      no 503 while the decode worker has free seats (its reported max_num_seqs + max_waiting)
#   2. TTFT breakdown: a disaggregated request's usage.ttft_breakdown ("timings": true) says
#      "remote", its parts are >= 0 and add up to its ttft_ms; the histograms count it on the
#      router and on the decode worker
#   3. trace: that request's spans (sent with a known W3C traceparent) are in the router's, the
#      decode worker's and the prefill worker's Chrome trace files, each naming the previous
#      process's span as its parent
#   4. /status in headless Chromium (DOM dump): roles, KV exports of the prefill worker, rejections
#      by class, charts with labelled axes and units; a 1366x768 screenshot
#      (PD_STATUS_SCREENSHOT=path keeps it)
#   5. router /health: 503 with only a prefill worker, 200 with a decode-capable one, 503 again once
#      that one is killed (and requests get 503 at once)
#   6. connections: ~20,000 idle connections to the router — /health answers within 1 s and the
#      log stays small; with --max-connections 1000 the longest-idle are closed and /health still
#      answers; a worker out of file descriptors (EMFILE: fd limit 512, --max-connections above it)
#      pauses accepting, logs one line, and answers /health within 1 s
# Needs curl, node, python3, chromium and prlimit.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
for t in curl node python3 chromium prlimit; do command -v $t >/dev/null || pd_fail "$t is required"; done
CLIENT="node $here/js/router_client.mjs"
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
router_start() {  # NAME FLAGS...
  name=$1; shift
  "$PD_BIN" router --host 127.0.0.1 --port 0 "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
  echo $! >"$TMP/$name.pid"
  pd_wait_for 20 grep -q 'http://' "$TMP/$name.out" || { cat "$TMP/$name.err" >&2; pd_fail "router $name did not start"; }
  eval "URL_$name=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/$name.out" | head -1)"
}
size() { wc -c <"$1" | tr -d ' '; }

# ---- 1. a 300-request burst through `pdserve run` ------------------------------------------------
"$PD_BIN" run --model "$MODEL" --port 0 --trace-dir "$TMP/trace" >"$TMP/run.out" 2>"$TMP/run.err" &
echo $! >"$TMP/run.pid"
pd_wait_for 120 grep -q 'router http://' "$TMP/run.out" || { cat "$TMP/run.err" >&2; pd_fail "pdserve run did not start"; }
R=$(grep -o 'router http://[0-9.]*:[0-9]*' "$TMP/run.out" | head -1 | grep -o 'http://.*')  # (--port 0: its own free port)
pd_wait_for 30 curl -sf "$R/health" || pd_fail "router /health never answered"
DEC=$(grep -o 'decode worker http://[0-9.]*:[0-9]*' "$TMP/run.out" | grep -o 'http://.*')
# the decode worker's own report: its seats and queue
pd_wait_for 10 sh -c "curl -s $R/status.json | grep -q '\"capacity\":[1-9]'" || pd_fail "the router never learnt the decode capacity"
cap=$(curl -s "$R/status.json" | json 'd["capacity"]')
seats=$(curl -s "$DEC/internal/state" | json 'd["load"]["max_seqs"]')
body=$(python3 -c 'import json; print(json.dumps({"prompt": list(range(100, 180)), "max_tokens": 16, "ignore_eos": True, "stream": True}))')
burst=$($CLIENT burst "$R" 300 "$body") || pd_fail "burst client: $burst"
echo "1. burst of 300 through pdserve run: $burst (decode seats $seats, router capacity $cap)"
[ "$(echo "$burst" | json 'd["rejected"]')" = 0 ] || pd_fail "503s while the decode worker had free seats: $burst"
[ "$(echo "$burst" | json 'd["ok"]')" = 300 ] || pd_fail "not every request was served: $burst"

# ---- 2. TTFT breakdown of a disaggregated request ----------------------------------------------------
trace_id=4bf92f3577b34da6a3ce929d0e0e$(python3 -c 'import random; print("%04x" % random.randrange(65536))')
parent=00f067aa0ba902b7
prompt=$(python3 -c 'import json,random; r=random.Random(7); print(json.dumps([r.randrange(10, 4000) for _ in range(160)]))')
curl -s "$R/v1/completions" -H "traceparent: 00-$trace_id-$parent-01" \
  -d "{\"prompt\":$prompt,\"max_tokens\":8,\"timings\":true}" >"$TMP/timed.json" || pd_fail "timed request"
python3 - "$TMP/timed.json" <<'EOF' || pd_fail "bad ttft_breakdown: $(cat "$TMP/timed.json")"
import json, sys
u = json.load(open(sys.argv[1]))["usage"]
b = u["ttft_breakdown"]
parts = [b[k] for k in ("queue_ms", "prefill_ms", "transfer_ms", "first_decode_ms")]
assert b["prefill"] == "remote", b
assert all(p >= 0 for p in parts), b
assert abs(sum(parts) - b["ttft_ms"]) < 0.01, b
assert b["prefill_ms"] > 0 and b["router_ms"] >= 0, b
print("2. ttft_breakdown:", json.dumps(b))
EOF
curl -s "$R/v1/completions" -d '{"prompt":"In the beginning","max_tokens":4}' | grep -q ttft_breakdown &&
  pd_fail "ttft_breakdown without the opt-in"
curl -s "$R/metrics" >"$TMP/r.metrics"
curl -s "$DEC/metrics" >"$TMP/d.metrics"
n=$(pd_metric "$TMP/r.metrics" 'pdserve_router_ttft_part_seconds_count{part="transfer"}')
[ "${n:-0}" -ge 301 ] || pd_fail "router TTFT part histogram: $n"
n=$(pd_metric "$TMP/d.metrics" 'pdserve_ttft_part_seconds_count{part="transfer",prefill="remote"}')
[ "${n:-0}" -ge 1 ] || pd_fail "decode worker remote TTFT histogram: $n"

# ---- 3. the request's spans in router, decode and prefill trace files ---------------------------
# The spans reach the files after the reply: wait (bounded) until each process wrote its span of
# this trace, then check them.
trace_written() { for svc in router decode prefill; do cat "$TMP/trace"/pdserve-$svc-*.json 2>/dev/null | grep -q "$trace_id" || return 1; done; }
pd_wait_for 20 trace_written || pd_fail "the trace files lack spans of trace $trace_id (files: $(ls "$TMP/trace"))"
python3 - "$TMP/trace" "$trace_id" "$parent" <<'EOF' || pd_fail "trace check failed (files: $(ls "$TMP/trace"))"
import glob, json, os, sys
d, tid, parent = sys.argv[1:4]
spans = {}
for f in glob.glob(os.path.join(d, "pdserve-*.json")):
    service = os.path.basename(f).split("-")[1]
    for line in open(f):
        line = line.strip().rstrip(",")
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        if e.get("ph") == "X" and e["args"].get("trace_id") == tid:
            spans.setdefault(service, []).append(e)
assert set(spans) >= {"router", "decode", "prefill"}, {k: len(v) for k, v in spans.items()}
def one(service, name):
    m = [e for e in spans[service] if e["name"] == name]
    assert len(m) == 1, (service, name, [e["name"] for e in spans[service]])
    return m[0]
r = one("router", "router.request")
w = one("decode", "worker.request")
p = one("prefill", "prefill_worker.prefill")
assert r["args"]["parent_span_id"] == parent, r
assert w["args"]["parent_span_id"] == r["args"]["span_id"], (w, r)
assert p["args"]["parent_span_id"] == w["args"]["span_id"], (p, w)
assert len({r["pid"], w["pid"], p["pid"]}) == 3
# the prefill happened inside the decode worker's request (one host, one clock; 5 ms slack)
assert w["ts"] - 5000 <= p["ts"] and p["ts"] + p["dur"] <= w["ts"] + w["dur"] + 5000, (p, w)
kids = sorted(e["name"] for e in spans["decode"] if e["args"]["parent_span_id"] == w["args"]["span_id"])
assert "remote_prefill" in kids and "queue" in kids, kids
print("3. trace %s: router %d, decode %d, prefill %d spans; chain router.request -> worker.request -> prefill_worker.prefill"
      % (tid, len(spans["router"]), len(spans["decode"]), len(spans["prefill"])))
EOF

# ---- 4. /status in headless Chromium ------------------------------------------------------------------
# The handoff counters reach the router with the workers' heartbeats: wait (bounded) for the prefill
# worker's KV exports there before the page is rendered.
exports_seen() {
  curl -sf "$R/status.json" | python3 -c 'import json, sys
sys.exit(0 if any(w["role"] == "prefill" and w["exports"] > 0 for w in json.load(sys.stdin)["workers"]) else 1)'
}
pd_wait_for 20 exports_seen || pd_fail "the router never showed the prefill worker's KV exports"
chrome() { chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$TMP/chrome" --virtual-time-budget=3000 "$@" 2>/dev/null; }
chrome --dump-dom "$R/status" >"$TMP/status.dom" || pd_fail "chromium --dump-dom failed"
python3 - "$TMP/status.dom" "$DEC" <<'EOF' || pd_fail "status page check failed"
import re, sys
dom, dec = open(sys.argv[1]).read(), sys.argv[2]
for text in ["Decode workers", "Prefill workers", "Rejections by class", "Handoff fallbacks", "time (s, 0 = now)", "TTFT (ms)",
             "handoffs/s", "GB/s", "requests", "rejections/s", "fallbacks/s", "worker_died", "premium", dec]:
    assert text in dom, "missing: " + text
assert dom.count('class="axis-label"') >= 16, "axis labels"
assert dom.count('class="tick"') >= 8 * 8, "tick values (drawn by the script)"
assert "<polygon" in dom or "<polyline" in dom, "no data drawn"
rows = re.search(r'<table id="prefill">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
cells = re.findall(r"<td[^>]*>([^<]*)</td>", rows)
assert cells and int(cells[4]) > 0, "prefill worker shows no KV exports: %r" % cells
print("4. /status: roles, exports %s, labelled axes; %d ticks" % (cells[4], dom.count('class="tick"')))
EOF
chrome --window-size=1366,768 --screenshot="$TMP/status.png" "$R/status" >/dev/null || pd_fail "chromium --screenshot failed"
[ -s "$TMP/status.png" ] || pd_fail "empty screenshot"
[ -n "${PD_STATUS_SCREENSHOT:-}" ] && cp "$TMP/status.png" "$PD_STATUS_SCREENSHOT"
kill "$(cat "$TMP/run.pid")"; wait "$(cat "$TMP/run.pid")" 2>/dev/null; rm -f "$TMP/run.pid"

# ---- 5. /health follows the decode-capable workers --------------------------------------------------------
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/kvtoken")
pd_start P --role prefill --kv-port 0 --auth-token-file "$TMP/kvtoken"
pd_start D
router_start H --prefill "$URL_P" --heartbeat-ms 100
code=$(curl -s -o "$TMP/h.json" -w '%{http_code}' "$URL_H/health")
[ "$code" = 503 ] || pd_fail "/health with only a prefill worker: $code $(cat "$TMP/h.json")"
grep -q '"decode_workers_healthy":0' "$TMP/h.json" || pd_fail "health body: $(cat "$TMP/h.json")"
kill "$(cat "$TMP/H.pid")"; wait "$(cat "$TMP/H.pid")" 2>/dev/null; rm -f "$TMP/H.pid"
router_start H2 --prefill "$URL_P" --worker "$URL_D" --heartbeat-ms 100
pd_wait_for 5 sh -c "[ \$(curl -s -o /dev/null -w '%{http_code}' $URL_H2/health) = 200 ]" || pd_fail "/health with a worker"
kill -9 "$(cat "$TMP/D.pid")"; rm -f "$TMP/D.pid"
pd_wait_for 5 sh -c "[ \$(curl -s -o /dev/null -w '%{http_code}' $URL_H2/health) = 503 ]" ||
  pd_fail "/health still $(curl -s "$URL_H2/health") with the decode worker dead"
code=$(curl -s -o /dev/null -w '%{http_code}' "$URL_H2/v1/completions" -d '{"prompt":"x","max_tokens":2}')
[ "$code" = 503 ] || pd_fail "a request without a decode worker: $code"
echo "5. /health: 503 (prefill only), 200 (worker up), 503 (worker killed)"
kill "$(cat "$TMP/H2.pid")"; wait "$(cat "$TMP/H2.pid")" 2>/dev/null; rm -f "$TMP/H2.pid"

# ---- 6. connection limits -------------------------------------------------------------------------------
pd_start A
router_start I --worker "$URL_A" --keepalive-timeout 300
out=$(python3 "$here/idle_conns.py" 127.0.0.1 "${URL_I##*:}" 20000 60) || pd_fail "idle_conns: $out"
echo "6. router, ~20,000 idle connections: $out; router log $(size "$TMP/I.err") bytes"
echo "$out" | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["established"] >= 15000, d
assert all(h["status"] == 200 and h["ms"] < 1000 for h in d["health"]), d' || pd_fail "router /health under idle connections"
[ "$(size "$TMP/I.err")" -lt 4096 ] || pd_fail "router log grew: $(tail -3 "$TMP/I.err")"
router_start J --worker "$URL_A" --max-connections 1000 --keepalive-timeout 300
out=$(python3 "$here/idle_conns.py" 127.0.0.1 "${URL_J##*:}" 3000 30) || pd_fail "idle_conns: $out"
echo "   router, --max-connections 1000, 3000 idle: $out"
echo "$out" | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["closed_by_server"] >= d["established"] - 1000, d
assert all(h["status"] == 200 and h["ms"] < 1000 for h in d["health"]), d' || pd_fail "shedding at --max-connections"
[ "$(size "$TMP/J.err")" -lt 4096 ] || pd_fail "router log grew: $(tail -3 "$TMP/J.err")"
prlimit --nofile=512:512 "$PD_BIN" serve --model "$MODEL" --host 127.0.0.1 --port 0 --max-connections 100000 \
  >"$TMP/E.out" 2>"$TMP/E.err" &
echo $! >"$TMP/E.pid"
pd_wait_for 60 grep -q 'http://' "$TMP/E.out" || pd_fail "worker E did not start"
URL_E=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/E.out" | head -1)
out=$(python3 "$here/idle_conns.py" 127.0.0.1 "${URL_E##*:}" 3000 30) || pd_fail "idle_conns: $out"
n_log=$(grep -c 'accept() failed' "$TMP/E.err")
echo "   worker at its fd limit (EMFILE), 3000 idle: $out; $n_log log line(s)"
echo "$out" | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert all(h["status"] == 200 and h["ms"] < 1000 for h in d["health"]), d' || pd_fail "worker /health at EMFILE"
[ "$n_log" -ge 1 ] && [ "$n_log" -le 3 ] || pd_fail "EMFILE log lines: $n_log"
[ "$(size "$TMP/E.err")" -lt 4096 ] || pd_fail "worker log grew: $(tail -3 "$TMP/E.err")"
curl -sf "$URL_E/v1/completions" -d '{"prompt":"In the beginning","max_tokens":4}' >/dev/null || pd_fail "worker E no longer serves"
echo "test_router_ops: all checks passed"
