#!/bin/sh
# test_router_fake.sh — the router against tests/helpers/fake_worker.py (deterministic tokens,
# python3 stdlib), on 127.0.0.1 with free ports (exit 0 = pass). Fast and model-free:
#   1. streaming failover: a worker SIGKILLed mid-stream; every stream (completions and chat) ends
#      with one [DONE], one id, no error, and exactly the tokens of an uninterrupted run
#   2. the dead worker leaves rotation (/health counts, /status.json state)
#   3. non-streaming requests after the kill are retried away from the dead worker
# Needs python3, curl and node.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is required"
command -v node >/dev/null || pd_fail "node is required"
FAKE="$repo/tests/helpers/fake_worker.py"
CLIENT="node $here/js/router_client.mjs"

fake_start() {  # NAME DELAY_MS
  python3 "$FAKE" 0 --token-delay-ms "$2" >"$TMP/$1.out" 2>"$TMP/$1.err" &
  echo $! >"$TMP/$1.pid"
  pd_wait_for 20 grep -q 'http://' "$TMP/$1.out" || pd_fail "fake worker $1 did not start"
  eval "URL_$1=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/$1.out")"
}
router_start() {  # NAME FLAGS...
  name=$1; shift
  "$PD_BIN" router --host 127.0.0.1 --port 0 "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
  echo $! >"$TMP/$name.pid"
  pd_wait_for 20 grep -q 'http://' "$TMP/$name.out" || { cat "$TMP/$name.err" >&2; pd_fail "router $name did not start"; }
  eval "URL_$name=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/$name.out" | head -1)"
}

fake_start F1 40
fake_start F2 40
router_start R --worker "$URL_F1" --worker "$URL_F2" --routing round-robin --heartbeat-ms 100
echo "fake workers $URL_F1 $URL_F2, router $URL_R"

# ---- 1. failover mid-stream (completions) -------------------------------------------------------
out=$($CLIENT failover "$URL_R" 6 40 "$(cat "$TMP/F1.pid")" 12 "$URL_F2") || pd_fail "completions failover: $out"
echo "failover (completions): $out"

# ---- 2. the dead worker is out of rotation ------------------------------------------------------
pd_wait_for 10 sh -c "curl -s $URL_R/status.json | grep -q '\"state\":\"down\"'" || pd_fail "F1 never marked down"
curl -s "$URL_R/health" | grep -q '"workers_healthy":1' || pd_fail "health: $(curl -s "$URL_R/health")"
curl -s "$URL_R/metrics" | grep -q '^pdserve_router_failovers_total [1-9]' || pd_fail "no failover counted"

# ---- 3. chat failover: bring a second worker, kill the one serving ------------------------------
fake_start F3 40
router_start R2 --worker "$URL_F2" --worker "$URL_F3" --routing round-robin --heartbeat-ms 100
body='{"messages":[{"role":"user","content":"hello"}],"max_tokens":30,"stream":true}'
curl -sN "$URL_R2/v1/chat/completions" -d "$body" >"$TMP/chat1.sse" &
c1=$!
curl -sN "$URL_R2/v1/chat/completions" -d "$body" >"$TMP/chat2.sse" &
c2=$!
pd_wait_for 10 sh -c "grep -q content $TMP/chat1.sse && grep -q content $TMP/chat2.sse" || pd_fail "chat streams did not start"
kill -9 "$(cat "$TMP/F3.pid")"
wait $c1 $c2
want=$(curl -s "$URL_F2/v1/chat/completions" -d '{"messages":[{"role":"user","content":"hello"}],"max_tokens":30}' |
       python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')
for f in chat1 chat2; do
  got=$(python3 - "$TMP/$f.sse" <<'EOF'
import json, sys
text, ids, done = "", set(), 0
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("data: "): continue
    d = line[6:]
    if d == "[DONE]": done += 1; continue
    j = json.loads(d)
    assert "error" not in j, j
    assert j["object"] == "chat.completion.chunk", j
    assert "token_ids" not in j["choices"][0], "token ids leaked to a client that did not ask"
    ids.add(j["id"])
    text += j["choices"][0]["delta"].get("content") or ""
assert done == 1 and len(ids) == 1, (done, ids)
print(text)
EOF
) || pd_fail "chat stream $f malformed"
  [ "$got" = "$want" ] || pd_fail "chat $f: got '$got' want '$want'"
done
echo "failover (chat): ok"

# ---- 4. non-streaming after a kill: retried on the live worker ------------------------------------
for i in 1 2 3 4; do
  code=$(curl -s -o "$TMP/ns.json" -w '%{http_code}' "$URL_R2/v1/completions" -d '{"prompt":"abc","max_tokens":3}')
  [ "$code" = 200 ] || pd_fail "non-streaming after kill: $code $(cat "$TMP/ns.json")"
done
echo "test_router_fake: all checks passed"
