#!/bin/sh
# test_http_errors.sh — every error the HTTP layer answers is an OpenAI-shaped JSON error with the
# right status (issue 18), on `pdserve serve`, `pdserve router` and `pdserve run`, on the bundled
# kjv-llama-6m (CPU), every server on a free loopback port (exit 0 = pass):
#   1. body limit, with curl: Content-Length bodies of exactly the limit (served: 200), limit + 1,
#      2x and 10x (413), with and without "Expect: 100-continue"; the same sizes chunked
#      (Transfer-Encoding: chunked, no length known in advance): 413 past the limit. Each 413 is
#      checked for status, Content-Type and the JSON error object (message, type, param, code).
#   2. raw sockets (http_errors.py raw): malformed request line / version / header / Content-Length
#      (400), request line or headers over 64 KiB (400), a malformed chunk (413), an unsupported
#      Expect (417), unknown and disallowed methods (501), unknown path (404), wrong method (405),
#      a 1 GB Content-Length with Expect: 100-continue (413 before any body is sent)
#   3. memory: a 100 MiB chunked upload is refused with a JSON 413 while the server's RSS grows by
#      no more than 4x the limit + 32 MiB (sampled every 20 ms; looser under ASan), and the server
#      keeps serving
#   4. the router (its own limit, larger than the worker's: the 413s are its own) and `pdserve run`
#      (the router in front of its workers, default 8 MiB limit): the same checks
# Needs curl and python3.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
pd_need python3
ERR="python3 $here/http_errors.py"
C=/v1/completions
# RSS growth allowed while a 100 MiB body is refused: 4x the limit + 32 MiB. Under ASan freed
# memory sits in its quarantine (256 MiB by default), so there the bound only catches gross growth.
rss_bound() { if [ -n "${ASAN_OPTIONS:-}" ]; then echo 512; else echo $(( 4 * $1 / 1048576 + 32 )); fi; }

# A completion request of exactly N bytes (valid JSON padded with spaces), and a body of N bytes.
mkbody() { python3 -c "import sys; n=int(sys.argv[1]); b=b'{\"prompt\":\"And\",\"max_tokens\":1}'; sys.stdout.buffer.write(b + b' '*(n-len(b)))" "$1" >"$2"; }

# post URL FILE MODE — MODE: cl (Content-Length, curl's default Expect), cl-noexpect, chunked.
# Writes the body to $TMP/body, echoes the status.
post() {
  case $3 in
    cl) set -- "$1" "$2" ;;
    cl-noexpect) set -- "$1" "$2" -H 'Expect:' ;;
    chunked) set -- "$1" "$2" -H 'Transfer-Encoding: chunked' ;;
  esac
  u=$1; f=$2; shift 2
  curl -s -m 60 -o "$TMP/body" -D "$TMP/headers" -w '%{http_code}' -H 'Content-Type: application/json' "$@" \
    --data-binary @"$f" "$u$C"
}

# is_json_error WHAT WANT_STATUS STATUS CODE — the reply in $TMP/body / $TMP/headers
is_json_error() {
  [ "$3" = "$2" ] || pd_fail "$1: status $3, want $2: $(head -c 300 "$TMP/body")"
  grep -qi '^content-type: application/json' "$TMP/headers" || pd_fail "$1: not application/json: $(cat "$TMP/headers")"
  python3 - "$TMP/body" "$4" <<'EOF' || pd_fail "$1: not an OpenAI error body: $(head -c 300 "$TMP/body")"
import json, sys
e = json.load(open(sys.argv[1]))["error"]
assert all(k in e for k in ("message", "type", "param", "code")), e
assert e["message"] and e["type"] == "invalid_request_error", e
assert sys.argv[2] == "-" or e["code"] == sys.argv[2], e
EOF
}

# limits URL LIMIT WHO — the curl checks of part 1 against one server
limits() {
  u=$1; lim=$2; who=$3
  mkbody "$lim" "$TMP/b1x"
  mkbody $((lim + 1)) "$TMP/b1x1"
  mkbody $((lim * 2)) "$TMP/b2x"
  mkbody $((lim * 10)) "$TMP/b10x"
  for mode in cl cl-noexpect chunked; do
    code=$(post "$u" "$TMP/b1x" $mode)
    [ "$code" = 200 ] || pd_fail "$who: a body of exactly the limit ($lim bytes, $mode): $code $(head -c 300 "$TMP/body")"
    for f in b1x1 b2x b10x; do
      code=$(post "$u" "$TMP/$f" $mode)
      is_json_error "$who: $f ($mode)" 413 "$code" request_too_large
    done
    echo "ok   $who: $mode bodies: limit 200, limit+1 / 2x / 10x 413 with a JSON error"
  done
}

# ---- serve ----------------------------------------------------------------------------------------
LIM=1048576
pd_start S --num-kv-blocks 256 --max-body-bytes $LIM
echo "serve: $URL_S (--max-body-bytes $LIM)"
limits "$URL_S" $LIM serve
$ERR raw "$URL_S" || pd_fail "serve: raw error cases"
$ERR upload "$URL_S" "$(cat "$TMP/S.pid")" 100 $(rss_bound $LIM) || pd_fail "serve: 100 MiB chunked upload"
[ "$(curl -s -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' -d '{"prompt":"And","max_tokens":2}' "$URL_S$C")" = 200 ] ||
  pd_fail "serve: no longer serving after the refusals"
# the refusals are counted in the status-code metric like any reply
curl -s "$URL_S/metrics" | grep -q 'status="413"' || pd_fail "serve: 413s not counted on /metrics"

# ---- router in front of serve ---------------------------------------------------------------------
RLIM=2097152
"$PD_BIN" router --host 127.0.0.1 --port 0 --worker "$URL_S" --max-body-bytes $RLIM >"$TMP/R.out" 2>"$TMP/R.err" &
echo $! >"$TMP/R.pid"
pd_wait_for 20 grep -q 'http://' "$TMP/R.out" || { cat "$TMP/R.err" >&2; pd_fail "router did not start"; }
URL_R=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/R.out" | head -1)
pd_wait_for 30 sh -c "curl -s $URL_R/health | grep -q ok" || pd_fail "router /health never ok"
echo "router: $URL_R (--max-body-bytes $RLIM) -> serve"
mkbody $((RLIM + 1)) "$TMP/r1x1"
mkbody $((RLIM * 2)) "$TMP/r2x"
mkbody $((RLIM * 10)) "$TMP/r10x"
for mode in cl cl-noexpect chunked; do
  for f in r1x1 r2x r10x; do
    code=$(post "$URL_R" "$TMP/$f" $mode)
    is_json_error "router: $f ($mode)" 413 "$code" request_too_large
    grep -q "limit $RLIM bytes" "$TMP/body" || pd_fail "router: $f ($mode): not the router's own refusal: $(cat "$TMP/body")"
  done
done
echo "ok   router: limit+1 / 2x / 10x bodies (Content-Length with and without Expect, chunked): JSON 413"
$ERR raw "$URL_R" || pd_fail "router: raw error cases"
$ERR upload "$URL_R" "$(cat "$TMP/R.pid")" 100 $(rss_bound $RLIM) || pd_fail "router: 100 MiB chunked upload"
code=$(post "$URL_R" "$TMP/b1x" cl)
[ "$code" = 200 ] || pd_fail "router: no longer serving after the refusals: $code"
kill "$(cat "$TMP/R.pid")"

# ---- pdserve run ----------------------------------------------------------------------------------
# --port 0: the router binds a free port itself and prints it (no port picked here and bound later,
# which another process may take in between)
"$PD_BIN" run --model "$MODEL" --port 0 --num-kv-blocks 256 >"$TMP/run.out" 2>"$TMP/run.err" &
echo $! >"$TMP/run.pid"
pd_wait_for 120 grep -q 'router http://' "$TMP/run.out" || { cat "$TMP/run.err" >&2; pd_fail "pdserve run did not start"; }
U=$(grep -o 'router http://[0-9.]*:[0-9]*' "$TMP/run.out" | head -1 | grep -o 'http://.*')
pd_wait_for 30 curl -sf "$U/health" || pd_fail "pdserve run: /health never answered"
DLIM=8388608  # the default --max-body-bytes
mkbody $((DLIM * 2)) "$TMP/d2x"
for mode in cl chunked; do
  code=$(post "$U" "$TMP/d2x" $mode)
  is_json_error "pdserve run: 2x the default limit ($mode)" 413 "$code" request_too_large
done
echo "ok   pdserve run: 16 MiB bodies (Content-Length, chunked): JSON 413"
$ERR raw "$U" || pd_fail "pdserve run: raw error cases"
echo "PASS test_http_errors"
