#!/bin/sh
# test_supervisor.sh — `pdserve run` as a supervisor (CPU, kjv-llama-6m, free loopback ports):
#   1. kill -9 of the prefill child during 24 concurrent greedy streams: all 24 complete with the
#      text of an undisturbed run (a colocated server), the router stays up, a new prefill child is
#      started and serves handoffs again within 10 s of the kill (the decode worker's
#      pdserve_kv_handoffs_total rises for a fresh prompt), and then a second load is handed off;
#   2. the workers listen on 127.0.0.1 only, the children form one process group;
#   3. kill -9 of the parent: no process of the group and no new /dev/shm file of it remains.
# Every wait is bounded.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
. "$here/lib/supervise.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is needed"
command -v curl >/dev/null || pd_fail "curl is needed"
MT=160

sv_prompts "$TMP/p_a.json" 24 2   # the load the prefill worker dies under
sv_prompts "$TMP/p_b.json" 24 3   # the load after its restart
sv_prompts "$TMP/probe.json" 40 4  # one fresh prompt per probe: never a prefix-cache hit

# The undisturbed reference: a colocated server (disaggregation does not change greedy text).
pd_start ref
sv_streams ref "$URL_ref" "$TMP/p_a.json" $MT
sv_check_streams ref 24
pd_stop ref

ls /dev/shm >"$TMP/shm.before" 2>/dev/null
"$PD_BIN" run --model "$MODEL" --port 0 --shutdown-timeout 300 >"$TMP/run.out" 2>"$TMP/run.err" &
run_pid=$!
echo $run_pid >"$TMP/run.pid"
pd_wait_for 120 grep -q '^Serving on http://' "$TMP/run.out" || { cat "$TMP/run.err" >&2; pd_fail "run did not start"; }
URL_RUN=$(grep -o 'Serving on http://[0-9.]*:[0-9]*' "$TMP/run.out" | grep -o 'http://.*')
URL_D=$(grep -o 'decode worker http://[0-9.]*:[0-9]*' "$TMP/run.out" | grep -o 'http://.*')
grep -q 'prefilled by the prefill worker; [0-9.]* KiB of KV moved' "$TMP/run.out" ||
  pd_fail "run's sample was not reported as handed off: $(grep 'pdserve run' "$TMP/run.out")"
prefill_pid() { pgrep -P "$run_pid" -f -- '--role prefill' | head -1; }
old=$(prefill_pid)
[ -n "$old" ] || pd_fail "no prefill child of run"

# ---- 2. listening addresses and the process group -------------------------------------------------------
kids=$(pgrep -P "$run_pid" | tr '\n' ' ')
pg=""
for k in $kids; do
  g=$(ps -o pgid= -p "$k" | tr -d ' ')
  [ -z "$pg" ] && pg=$g
  [ "$g" = "$pg" ] || pd_fail "run's children are in different process groups ($pg, $g)"
done
[ "$pg" != "$(ps -o pgid= -p "$run_pid" | tr -d ' ')" ] || pd_fail "the children share the terminal's group with run"
if command -v ss >/dev/null; then
  for k in $kids; do
    case "$(tr '\0' ' ' </proc/"$k"/cmdline)" in *" serve "*) ;; *) continue ;; esac
    wide=$(ss -Hltnp 2>/dev/null | grep "pid=$k," | awk '{print $4}' | grep -v '^127\.0\.0\.1:' || true)
    [ -z "$wide" ] || pd_fail "worker $k listens beyond loopback: $wide"
  done
fi
echo "2. children: one process group ($pg), workers on 127.0.0.1 only"

# ---- 1. kill -9 of the prefill child under load ---------------------------------------------------------
h0=$(sv_metric "$URL_D" pdserve_kv_handoffs_total)
sv_streams a "$URL_RUN" "$TMP/p_a.json" $MT 2
sv_wait_file "$TMP/a.ready" 120 || pd_fail "the streams never started"
kill -9 "$old"
t_kill=$(date +%s)
# Probe with fresh prompts until a handoff is counted again (the new child's).
h_dead=$(sv_metric "$URL_D" pdserve_kv_handoffs_total)
i=0
served=""
while [ $(( $(date +%s) - t_kill )) -lt 10 ]; do
  new=$(prefill_pid)
  if [ -n "$new" ] && [ "$new" != "$old" ]; then
    body=$(python3 -c "import json,sys; print(json.dumps({'prompt': json.load(open(sys.argv[1]))[int(sys.argv[2])], 'max_tokens': 2, 'temperature': 0}))" "$TMP/probe.json" $i)
    curl -sf -m 5 "$URL_RUN/v1/completions" -H 'Content-Type: application/json' -d "$body" >/dev/null
    i=$((i + 1))
    h=$(sv_metric "$URL_D" pdserve_kv_handoffs_total)
    if [ "$h" -gt "$h_dead" ]; then served=$(( $(date +%s) - t_kill )); break; fi
  fi
  [ $i -ge 40 ] && break
  sleep 0.2
done
[ -n "$served" ] || { tail -20 "$TMP/run.err" >&2; pd_fail "no handoff served by a new prefill child within 10 s of the kill"; }
echo "  a new prefill child ($(prefill_pid)) served a handoff ${served} s after the kill"
sv_check_streams a 24 "$TMP/ref.json"
kill -0 "$run_pid" 2>/dev/null || pd_fail "run exited after its prefill child was killed"
curl -sf "$URL_RUN/health" >/dev/null || pd_fail "the router is down after the prefill child was killed"
grep -q 'the prefill process was killed by signal 9' "$TMP/run.err" || pd_fail "run did not log the death"
grep -q 'restarted the prefill process' "$TMP/run.err" || pd_fail "run did not log the restart"
h1=$(sv_metric "$URL_D" pdserve_kv_handoffs_total)
sv_streams b "$URL_RUN" "$TMP/p_b.json" 16
sv_check_streams b 24
h2=$(sv_metric "$URL_D" pdserve_kv_handoffs_total)
[ "$h2" -ge $((h1 + 24)) ] || pd_fail "after the restart 24 fresh prompts made $((h2 - h1)) handoffs, not 24"
echo "1. kill -9 of the prefill child: 24/24 streams complete and identical, handoffs $h0 -> $h1 -> $h2"

# ---- 3. kill -9 of the parent ---------------------------------------------------------------------------
kids=$(pgrep -P "$run_pid" | tr '\n' ' ')
kill -9 "$run_pid"
sv_wait_exit "$run_pid" 10 || pd_fail "run did not die"
rm -f "$TMP/run.pid"
end=$(( $(date +%s) + 10 ))
while :; do
  alive=""
  for k in $kids; do kill -0 "$k" 2>/dev/null && alive="$alive $k"; done
  [ -z "$alive" ] && break
  [ "$(date +%s)" -ge "$end" ] && { for k in $alive; do kill -9 "$k"; done; pd_fail "children$alive outlived run's kill -9"; }
  sleep 0.1
done
pgrep -g "$pg" >/dev/null && pd_fail "processes of run's group $pg remain: $(pgrep -g "$pg" | tr '\n' ' ')"
ls /dev/shm >"$TMP/shm.after" 2>/dev/null
left=""
for k in $kids; do
  left="$left$(comm -13 "$TMP/shm.before" "$TMP/shm.after" | grep -- "-$k-" || true)"
done
if [ -n "$left" ]; then
  for f in $left; do rm -f "/dev/shm/$f"; done  # ours: do not litter the machine
  pd_fail "kill -9 of run left /dev/shm files behind (removed now): $left"
fi
echo "3. kill -9 of run: no child and no /dev/shm file left"
echo "PASS test_supervisor"
