#!/bin/sh
# The Redis KV pool across worker deaths and Redis's own evictions (issue 14 item 4), on the CPU
# backend against a redis-server this test starts on a free loopback port (requirepass: the shared
# secret; notify-keyspace-events KEgx) and kills at the end:
#   1. colocated: router + 2 workers on the pool. One greedy stream is SIGKILLed with its worker
#      after 100 generated tokens; the router continues it on the other worker (prompt + generated
#      ids), whose output equals an uninterrupted run and which loads the prompt and the generated
#      blocks the dead worker wrote back from the pool: it computes only the tail (< 2 blocks + the
#      partial one) of the 164-token continuation;
#      the same for a chat stream (the router's token ids of the chat template + generated ids);
#   2. disaggregated: router + a prefill worker + 2 decode workers, all on the pool. The decode
#      worker streaming is SIGKILLed; the other decode worker hands the continuation to the prefill
#      worker, which finds the prompt in its device cache and the dead decode worker's generated
#      blocks in the pool: it computes only the tail; output equal;
#   3. Redis evicts by itself (maxmemory 4 MB, allkeys-lru): a workload 5x that size; the router's
#      prefix index (/status.json prefix_blocks.redis) ends up listing exactly the blocks Redis still
#      holds (not every block ever written), and pdserve_kv_tier_evictions_total{tier="redis"} and
#      pdserve_kv_tier_redis_removed_total{reason="evicted"} count Redis's evicted_keys.
. "$(dirname "$0")/lib/server.sh"
pd_setup
pd_need python3 redis-server redis-cli
here=$(cd "$(dirname "$0")" && pwd)

(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/token")
SECRET=$(cat "$TMP/token")
start_redis() { pd_redis_start "$SECRET" --notify-keyspace-events KEgx "$@"; }  # start_redis [EXTRA FLAGS...]
kill_redis() {
  kill -9 "$(cat "$TMP/redis.pid")" 2>/dev/null
  wait "$(cat "$TMP/redis.pid")" 2>/dev/null
  rm -f "$TMP/redis.pid"
}
rcli() { REDISCLI_AUTH="$SECRET" redis-cli -p "$RPORT" "$@"; }
router_start() {  # router_start WORKER_URL...
  args=""
  for u in "$@"; do args="$args --worker $u"; done
  # shellcheck disable=SC2086
  "$PD_BIN" router --host 127.0.0.1 --port 0 $args --auth-token-file "$TMP/token" --routing round-robin \
    --heartbeat-ms 100 >"$TMP/router.out" 2>"$TMP/router.err" &
  echo $! >"$TMP/router.pid"
  pd_wait_for 20 grep -q 'http://' "$TMP/router.out" || { cat "$TMP/router.err" >&2; pd_fail "router did not start"; }
  RURL=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/router.out" | head -1)
  pd_wait_for 20 sh -c "curl -sf '$RURL/health' | grep -q '\"workers_healthy\":$#'" || pd_fail "router: workers not healthy"
}
router_stop() { kill "$(cat "$TMP/router.pid")"; wait "$(cat "$TMP/router.pid")" 2>/dev/null; rm -f "$TMP/router.pid"; }
metric() { curl -sf "$1/metrics" | awk -v re="$2" '$1 ~ re {s += $2} END {printf "%d\n", s + 0}'; }

python3 - "$TMP" <<'PY'
import json, random, sys
d = sys.argv[1]
rng = random.Random(1414)
json.dump([rng.randrange(10, 4000) for _ in range(64)], open(d + "/p.json", "w"))   # 4 blocks
json.dump([[rng.randrange(10, 4000) for _ in range(96)] for _ in range(40)], open(d + "/many.json", "w"))
json.dump([{"role": "system", "content": "You are a scribe of the old books, and you answer in their words."},
           {"role": "user", "content": "Tell of the beginning of all things, of the waters and the light, and of the days."}],
          open(d + "/m.json", "w"))
PY

POOL="--num-kv-blocks 128 --auth-token-file $TMP/token"
MAXT=400
KILL_AFTER=100
# ---- reference: the uninterrupted greedy run, tiers off ----
pd_start ref $POOL
curl -sf "$URL/v1/completions" -d "{\"prompt\":$(cat "$TMP/p.json"),\"max_tokens\":$MAXT,\"temperature\":0,\"ignore_eos\":true}" \
  >"$TMP/ref.json" || pd_fail "reference run failed"
curl -sf "$URL/v1/chat/completions" -d "{\"messages\":$(cat "$TMP/m.json"),\"max_tokens\":$MAXT,\"temperature\":0,\"ignore_eos\":true}" \
  >"$TMP/ref_chat.json" || pd_fail "reference chat run failed"
pd_stop ref

failover() {  # failover LABEL [--chat] WORKER=PID... → $TMP/LABEL.json; checks the output
  label=$1; shift
  ref=ref req=p chat=""
  [ "$1" = --chat ] && { ref=ref_chat req=m chat=--chat; shift; }
  wargs=""
  for w in "$@"; do wargs="$wargs --worker $w"; done
  # shellcheck disable=SC2086
  # Killed once it wrote back every block filled by the first KILL_AFTER tokens (write-back is
  # asynchronous; on a loaded machine it may trail the stream by several blocks).
  plen=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['usage']['prompt_tokens'])" "$TMP/$ref.json")
  python3 "$here/kv_failover_client.py" "$RURL" "$TMP/$req.json" "$TMP/$label.json" --max-tokens $MAXT \
    --kill-after $KILL_AFTER --wait-puts $(((plen + KILL_AFTER) / 16)) $chat $wargs || pd_fail "$label: client failed"
  python3 - "$TMP/$ref.json" "$TMP/$label.json" "$label" <<'PY' || exit 1
import json, sys
ref, got, label = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
if got["errors"] or not got["done"]:
    sys.exit("FAIL %s: errors %s, done %s" % (label, got["errors"], got["done"]))
if not got["killed"]:
    sys.exit("FAIL %s: no worker was killed" % label)
want = ref["choices"][0]["message"]["content"] if "message" in ref["choices"][0] else ref["choices"][0]["text"]
if got["text"] != want or len(got["token_ids"]) != ref["usage"]["completion_tokens"]:
    sys.exit("FAIL %s: the output after failover differs from the uninterrupted run" % label)
print("%s: killed %s after %d tokens; %d tokens, output identical" % (label, got["killed"], got["ids_at_kill"], len(got["token_ids"])))
PY
  KILLED=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['killed'])" "$TMP/$label.json")
  AT=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['ids_at_kill'])" "$TMP/$label.json")
}
# The continuation's prompt (prompt + the tokens the router relayed: AT or a few more) as the new
# worker counted it; of its full blocks, DEVICE_HIT tokens were in the device cache.
check_pool_load() {  # check_pool_load LABEL URL DEVICE_HIT [COMPUTED_BEFORE PROMPT_BEFORE TIER_TOKENS_BEFORE]
  label=$1 u=$2 dev=$3
  cont=$(($(metric "$u" '^pdserve_prompt_tokens_total') - ${5:-0}))
  [ "$cont" -ge $((AT + 16)) ] || pd_fail "$label: a continuation of $cont tokens after $AT generated"
  full=$((cont / 16 * 16))
  tok=$(($(metric "$u" '^pdserve_kv_tier_hit_tokens_total') - ${6:-0}))
  comp=$(($(metric "$u" '^pdserve_prefill_tokens_computed_total') - ${4:-0}))
  echo "$label: continuation of $cont tokens: $dev from the device cache, $tok from the pool, $comp computed"
  # The blocks written back after the kill point (a few more tokens were generated) may be lost
  # with the worker: at most 2.
  [ "$tok" -ge $((full - dev - 32)) ] || pd_fail "$label: only $tok tokens from the pool (want >= $((full - dev - 32)))"
  [ $((dev + tok + comp)) -eq "$cont" ] || pd_fail "$label: $dev + $tok + $comp != $cont"
  [ "$comp" -le $((cont - full + 32)) ] || pd_fail "$label: $comp of $cont tokens computed"
}

# ---- 1. colocated workers on the pool ----
start_redis
pd_start A $POOL --kv-remote "redis://127.0.0.1:$RPORT"
pd_start B $POOL --kv-remote "redis://127.0.0.1:$RPORT"
router_start "$URL_A" "$URL_B"
failover colocated "$URL_A=$(cat "$TMP/A.pid")" "$URL_B=$(cat "$TMP/B.pid")"
[ "$KILLED" = "$URL_A" ] && { rm -f "$TMP/A.pid"; LIVE=$URL_B; } || { rm -f "$TMP/B.pid"; LIVE=$URL_A; }
check_pool_load "1. colocated" "$LIVE" 0
router_stop
# A chat stream: the router tokenizes the chat (the template's ids) and continues it as ids.
pd_start C $POOL --kv-remote "redis://127.0.0.1:$RPORT"
[ -e "$TMP/A.pid" ] && { X=A; URL_X=$URL_A; } || { X=B; URL_X=$URL_B; }
cx=$(metric "$URL_X" '^pdserve_prefill_tokens_computed_total') tx=$(metric "$URL_X" '^pdserve_kv_tier_hit_tokens_total')
px=$(metric "$URL_X" '^pdserve_prompt_tokens_total')
router_start "$URL_X" "$URL_C"
failover colocated_chat --chat "$URL_X=$(cat "$TMP/$X.pid")" "$URL_C=$(cat "$TMP/C.pid")"
if [ "$KILLED" = "$URL_X" ]; then rm -f "$TMP/$X.pid"; check_pool_load "1. chat" "$URL_C" 0
else rm -f "$TMP/C.pid"; check_pool_load "1. chat" "$URL_X" 0 "$cx" "$px" "$tx"; fi
router_stop
for n in A B C; do [ -e "$TMP/$n.pid" ] && pd_stop $n; done
kill_redis

# ---- 2. disaggregated: a decode worker dies ----
start_redis
pd_start P --role prefill --kv-port 0 $POOL --kv-remote "redis://127.0.0.1:$RPORT"
kv=$(grep -o 'KV port [0-9.]*:[0-9]*' "$TMP/P.out" | head -1 | awk '{print $3}')
[ -n "$kv" ] || pd_fail "the prefill worker did not print its KV port"
pd_start D1 --role decode --prefill "$kv" $POOL --kv-remote "redis://127.0.0.1:$RPORT"
pd_start D2 --role decode --prefill "$kv" $POOL --kv-remote "redis://127.0.0.1:$RPORT"
for u in "$URL_D1" "$URL_D2"; do
  pd_wait_for 30 sh -c "curl -sf '$u/metrics' | grep -q '^pdserve_kv_prefill_workers_healthy 1'" || pd_fail "decode worker never connected"
done
router_start "$URL_D1" "$URL_D2"
failover disaggregated "$URL_D1=$(cat "$TMP/D1.pid")" "$URL_D2=$(cat "$TMP/D2.pid")"
[ "$KILLED" = "$URL_D1" ] && { rm -f "$TMP/D1.pid"; LIVE=$URL_D2; } || { rm -f "$TMP/D2.pid"; LIVE=$URL_D1; }
[ "$(metric "$LIVE" '^pdserve_kv_handoffs_total')" -eq 1 ] || pd_fail "2. the continuation was not handed to the prefill worker"
# The prefill worker computed the 64-token prompt once; its device cache still holds those 4 blocks.
check_pool_load "2. disaggregated (prefill worker)" "$URL_P" 64 64 64
router_stop
[ -e "$TMP/D1.pid" ] && pd_stop D1
[ -e "$TMP/D2.pid" ] && pd_stop D2
pd_stop P
kill_redis

# ---- 3. Redis evicts by itself: routers hear it ----
# A kjv-llama-6m f32 page is 98,496 bytes: 4 MB of maxmemory (less Redis's own ~1 MB) holds ~30;
# the workload writes 40 x 6 = 240.
start_redis --maxmemory 4mb --maxmemory-policy allkeys-lru
pd_start W --num-kv-blocks 40 --max-num-seqs 4 --auth-token-file "$TMP/token" --kv-remote "redis://127.0.0.1:$RPORT"
router_start "$URL_W"
python3 "$here/disagg_client.py" "$RURL" "$TMP/many.json" "$TMP/many.out.json" --concurrency 4 --max-tokens 8 ||
  pd_fail "3. the workload failed"
pd_wait_for 60 sh -c "[ \$(curl -sf '$URL_W/metrics' | awk '/^pdserve_kv_tier_offloads_total/ {print \$2}') -ge 240 ]" ||
  pd_fail "3. the worker did not offload its blocks"
evicted=$(rcli info stats | awk -F: '/^evicted_keys/ {print $2+0}')
[ "$evicted" -ge 100 ] || pd_fail "3. Redis evicted only $evicted keys: the workload does not exceed maxmemory"
in_redis() { rcli --scan --pattern 'pdkv:*' | wc -l; }
router_redis() {
  curl -sf "$RURL/status.json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["workers"][0]["prefix_blocks"]["redis"])'
}
settled() {  # the router lists exactly what Redis holds, and the worker counted every eviction
  [ "$(router_redis)" -eq "$(in_redis)" ] &&
    [ "$(metric "$URL_W" '^pdserve_kv_tier_evictions_total\{tier="redis"\}')" -eq "$(rcli info stats | awk -F: '/^evicted_keys/ {print $2+0}')" ]
}
pd_wait_for 20 settled || pd_fail "3. router lists $(router_redis) blocks in redis, Redis holds $(in_redis); worker counted $(metric "$URL_W" '^pdserve_kv_tier_evictions_total\{tier="redis"\}') of $(rcli info stats | awk -F: '/^evicted_keys/ {print $2+0}') evictions"
puts=$(metric "$URL_W" '^pdserve_kv_tier_puts_total\{tier="redis"\}')
rm_ev=$(metric "$URL_W" '^pdserve_kv_tier_redis_removed_total\{reason="evicted"\}')
ign=$(metric "$URL_W" '^pdserve_kv_tier_redis_notifications_ignored_total')
evicted=$(rcli info stats | awk -F: '/^evicted_keys/ {print $2+0}')
[ "$rm_ev" -eq "$evicted" ] || pd_fail "3. removed{evicted} $rm_ev != Redis evicted_keys $evicted"
[ "$ign" -eq 0 ] || pd_fail "3. $ign notifications ignored"
echo "3. Redis evictions: $puts pages written, $evicted evicted by Redis (all counted); the router lists $(router_redis) in redis = what Redis holds"
# A foreign key, another fingerprint and a bad hash under our prefix: heard, ignored and counted.
fp=$(rcli --scan --pattern 'pdkv:*' | head -1 | cut -d: -f2)
rcli set "pdkv:$fp:nothex" x >/dev/null
rcli del "pdkv:$fp:nothex" >/dev/null
rcli set "pdkv:$fp:0123" x >/dev/null
rcli del "pdkv:$fp:0123" >/dev/null
pd_wait_for 10 sh -c "[ \$(curl -sf '$URL_W/metrics' | awk '/^pdserve_kv_tier_redis_notifications_ignored_total/ {print \$2}') -ge 2 ]" ||
  pd_fail "3. malformed notifications were not counted"
# An operator deleting our pages: removed too.
k=$(rcli --scan --pattern "pdkv:$fp:*" | head -1)
rcli del "$k" >/dev/null
pd_wait_for 10 settled || pd_fail "3. a deleted page is still listed by the router"
echo "3. malformed keys ignored and counted; a DEL by hand removed from the router's index"
router_stop
pd_stop W
kill_redis
echo "PASS test_kv_pool"
