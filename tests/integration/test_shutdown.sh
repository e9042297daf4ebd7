#!/bin/sh
# test_shutdown.sh — graceful shutdown (SIGTERM) of `serve`, `router` and `run`, each during 24
# concurrent greedy streams (CPU, kjv-llama-6m, free loopback ports). For each:
#   * after the signal /health answers 503 {"status":"draining"} and a new request gets 503 +
#     Retry-After with an OpenAI error body;
#   * all 24 running streams complete ([DONE], finish_reason "length"), with the text of an
#     undisturbed run of the same prompts;
#   * the process exits by itself with status 0 (run: and no child process or /dev/shm file of
#     it is left).
# And the deadline: `serve --shutdown-timeout 1` ends streams that cannot finish in time with an
# SSE error event and no [DONE], and still exits 0.
# Every wait is bounded; the shutdown timeouts are generous (300 s) so no check depends on speed.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
. "$here/lib/supervise.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is needed"
command -v curl >/dev/null || pd_fail "curl is needed"
MT=160  # tokens per stream: the streams are still running when the signal comes

sv_prompts "$TMP/p.json" 24 1

# ---- serve ----------------------------------------------------------------------------------------
pd_start W --shutdown-timeout 300
sv_streams ref "$URL_W" "$TMP/p.json" $MT
sv_check_streams ref 24
sv_streams s1 "$URL_W" "$TMP/p.json" $MT
sv_wait_file "$TMP/s1.ready" 120 || pd_fail "serve: the streams never started"
pid=$(cat "$TMP/W.pid")
kill -TERM "$pid"
sv_check_draining "$URL_W"
sv_check_streams s1 24 "$TMP/ref.json"
sv_wait_exit "$pid" 60 || pd_fail "serve did not exit after its streams finished"
[ "$SV_RC" = 0 ] || pd_fail "serve exited with status $SV_RC after SIGTERM"
rm -f "$TMP/W.pid"
grep -q 'drained' "$TMP/W.err" || pd_fail "serve did not log its drain"
echo "1. serve: SIGTERM during 24 streams: all complete, exit 0"

# ---- serve, deadline passed ---------------------------------------------------------------------------
pd_start T --shutdown-timeout 1
sv_streams s2 "$URL_T" "$TMP/p.json" 1500
sv_wait_file "$TMP/s2.ready" 120 || pd_fail "serve (timeout): the streams never started"
pid=$(cat "$TMP/T.pid")
kill -TERM "$pid"
sv_wait_exit "$pid" 60 || pd_fail "serve --shutdown-timeout 1 did not exit"
[ "$SV_RC" = 0 ] || pd_fail "serve --shutdown-timeout 1 exited with status $SV_RC"
rm -f "$TMP/T.pid"
sv_wait_exit "$(cat "$TMP/s2.cpid")" 60 || pd_fail "the cut streams' client did not finish"
python3 - "$TMP/s2.json" <<'PY' || exit 1
import json, sys
d = json.load(open(sys.argv[1]))
cut = [i for i in range(24) if not d["done"][i] and d["errors"][i] and "shutting down" in d["errors"][i]]
if len(cut) != 24:
    i = next(i for i in range(24) if i not in cut)
    sys.exit("FAIL deadline: %d of 24 streams ended with the shutdown error event and no [DONE]; stream %d: done=%s error=%s"
             % (len(cut), i, d["done"][i], d["errors"][i]))
PY
echo "2. serve --shutdown-timeout 1: 24 streams cut with an SSE error event (no [DONE]), exit 0"

# ---- router -----------------------------------------------------------------------------------------
pd_start W2 --shutdown-timeout 300
"$PD_BIN" router --host 127.0.0.1 --port 0 --worker "$URL_W2" --shutdown-timeout 300 >"$TMP/R.out" 2>"$TMP/R.err" &
echo $! >"$TMP/R.pid"
pd_wait_for 20 grep -q 'http://' "$TMP/R.out" || { cat "$TMP/R.err" >&2; pd_fail "router did not start"; }
URL_R=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/R.out" | head -1)
pd_wait_for 20 curl -sf "$URL_R/health" || pd_fail "router: /health never answered 200"
sv_streams s3 "$URL_R" "$TMP/p.json" $MT
sv_wait_file "$TMP/s3.ready" 120 || pd_fail "router: the streams never started"
pid=$(cat "$TMP/R.pid")
kill -TERM "$pid"
sv_check_draining "$URL_R"
sv_check_streams s3 24 "$TMP/ref.json"
sv_wait_exit "$pid" 60 || pd_fail "router did not exit after its streams finished"
[ "$SV_RC" = 0 ] || pd_fail "router exited with status $SV_RC after SIGTERM"
rm -f "$TMP/R.pid"
curl -sf "$URL_W2/health" >/dev/null || pd_fail "the worker behind the router went down with it"
echo "3. router: SIGTERM during 24 streams: all complete, exit 0, the worker still serves"
pd_stop W2

# ---- run ----------------------------------------------------------------------------------------------
ls /dev/shm >"$TMP/shm.before" 2>/dev/null
"$PD_BIN" run --model "$MODEL" --port 0 --shutdown-timeout 300 >"$TMP/run.out" 2>"$TMP/run.err" &
echo $! >"$TMP/run.pid"
run_pid=$!
pd_wait_for 120 grep -q '^Serving on http://' "$TMP/run.out" || { cat "$TMP/run.err" >&2; pd_fail "run did not start"; }
URL_RUN=$(grep -o 'Serving on http://[0-9.]*:[0-9]*' "$TMP/run.out" | grep -o 'http://.*')
kids=$(pgrep -P "$run_pid" | tr '\n' ' ')
[ -n "$kids" ] || pd_fail "run has no child processes"
sv_streams s4 "$URL_RUN" "$TMP/p.json" $MT
sv_wait_file "$TMP/s4.ready" 120 || pd_fail "run: the streams never started"
kill -TERM "$run_pid"
sv_check_draining "$URL_RUN"
sv_check_streams s4 24 "$TMP/ref.json"
sv_wait_exit "$run_pid" 90 || pd_fail "run did not exit after its streams finished"
[ "$SV_RC" = 0 ] || { tail -20 "$TMP/run.err" >&2; pd_fail "run exited with status $SV_RC after SIGTERM"; }
rm -f "$TMP/run.pid"
for k in $kids; do
  kill -0 "$k" 2>/dev/null && pd_fail "run's child $k is still alive after run exited"
done
ls /dev/shm >"$TMP/shm.after" 2>/dev/null
new=""
for k in $kids; do  # other servers on this machine may make their own files meanwhile
  new="$new$(comm -13 "$TMP/shm.before" "$TMP/shm.after" | grep -- "-$k-" || true)"
done
[ -z "$new" ] || pd_fail "run left /dev/shm files behind: $new"
grep -q 'stopping the router' "$TMP/run.err" || pd_fail "run did not log its ordered shutdown"
echo "4. run: SIGTERM during 24 streams: all complete, exit 0, no child or /dev/shm file left"
echo "PASS test_shutdown"
