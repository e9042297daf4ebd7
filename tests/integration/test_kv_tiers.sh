#!/bin/sh
# The KV tiers below the device pool (--kv-offload-dram, --kv-offload-disk, --kv-remote; issue 14)
# served end to end on the CPU backend, against a real redis-server this test starts on a free
# loopback port (requirepass: the shared secret) and kills at the end:
#   1. greedy outputs with tiers on are identical to tiers off, over a workload whose working set
#      (28 prompts x 6 blocks) is over 4x the device pool (40 blocks), run three times (forward,
#      reversed, forward), and the tiers serve hits from DRAM, disk and Redis (counted on /metrics),
#      with the prompt tokens computed going down by what was loaded;
#   2. a restart with the same disk directory: the first repeated prompt is a disk hit;
#   3. bytes flipped in every page file on disk (8 prompts' pages, all written first): each load
#      detects its first page bad (8 bad pages counted, nothing loaded), the prompt is recomputed
#      and the output is still identical;
#   4. Redis killed mid-run (kill -9): every request completes, outputs identical;
#   5. two workers share a prefix through Redis: the second computes only the new part of its
#      prompt (prompt tokens computed = prompt - tokens loaded from the pool);
#   6. bad flag values are clear errors naming the flag.
. "$(dirname "$0")/lib/server.sh"
pd_setup
pd_need python3 redis-server redis-cli
here=$(cd "$(dirname "$0")" && pwd)

(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/token")
SECRET=$(cat "$TMP/token")

start_redis() { pd_redis_start "$SECRET"; }
kill_redis() {
  kill -9 "$(cat "$TMP/redis.pid")" 2>/dev/null
  wait "$(cat "$TMP/redis.pid")" 2>/dev/null
  rm -f "$TMP/redis.pid"
}

# Prompts: 28 distinct ones of 96 tokens (6 blocks of 16) from the model's own vocabulary.
python3 - "$TMP" <<'PY'
import json, random, sys
d = sys.argv[1]
rng = random.Random(14)
ps = [[rng.randrange(10, 4000) for _ in range(96)] for _ in range(28)]
json.dump(ps, open(d + "/fwd.json", "w"))
json.dump(ps[::-1], open(d + "/rev.json", "w"))
json.dump(ps[:1], open(d + "/first.json", "w"))
json.dump(ps[1:9], open(d + "/some.json", "w"))
shared = [rng.randrange(10, 4000) for _ in range(160)]  # 10 blocks
json.dump([shared], open(d + "/shared.json", "w"))
json.dump([shared + [rng.randrange(10, 4000) for _ in range(40)]], open(d + "/shared_more.json", "w"))
PY

metric() { curl -sf "$1/metrics" | awk -v re="$2" '$1 ~ re {s += $2} END {printf "%d\n", s + 0}'; }
run() {  # run URL PROMPTS OUT LABEL [CONC]
  python3 "$here/disagg_client.py" "$1" "$2" "$3" --concurrency "${5:-4}" --max-tokens 8 || pd_fail "$4: run failed"
}
same() {  # same REF GOT LABEL [reversed]
  python3 - "$@" <<'PY' || exit 1
import json, sys
ref, got, label = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
r, g = ref["texts"], got["texts"]
if len(sys.argv) > 4:
    g = g[::-1]
if got["errors"]:
    sys.exit("FAIL %s: %d requests failed: %s" % (label, got["errors"], got["error_list"]))
bad = [i for i, (a, b) in enumerate(zip(r, g)) if a != b]
if bad or len(r) < len(g):
    sys.exit("FAIL %s: %d of %d outputs differ (first: %s)" % (label, len(bad), len(g), bad[:1]))
print("%s: %d outputs identical" % (label, len(g)))
PY
}

POOL="--num-kv-blocks 40 --max-num-seqs 4 --auth-token-file $TMP/token"
# A page of kjv-llama-6m at f32: 96 + 6 layers x 2 x 2 heads x (4 + 16 x 64 x 4) = 98,496 bytes
# (102,400 on disk, 4 KiB aligned). DRAM holds 48 of them, the disk 300: 168 blocks in the set.
TIERS="--kv-offload-dram 4700k --kv-offload-disk $TMP/disk --kv-offload-disk-size 30M"

# ---- 6. flag errors (no model load needed for most; each must name its flag) ----
bad_flag() {  # bad_flag WANT FLAGS...
  want=$1; shift
  "$PD_BIN" serve --model "$MODEL" --port 0 "$@" >"$TMP/bad.out" 2>&1 && pd_fail "accepted: $*"
  grep -q -- "$want" "$TMP/bad.out" || { cat "$TMP/bad.out" >&2; pd_fail "error for '$*' does not name $want"; }
}
bad_flag --kv-offload-dram --kv-offload-dram 12Q
bad_flag --kv-offload-dram --kv-offload-dram 0
bad_flag --kv-offload-disk-size --kv-offload-disk "$TMP/x"
bad_flag --kv-offload-disk-size --kv-offload-disk "$TMP/x" --kv-offload-disk-size lots
bad_flag --kv-remote --kv-remote http://127.0.0.1:6379
bad_flag --kv-remote --kv-remote redis://127.0.0.1:99999
bad_flag --kv-offload-dtype --kv-offload-disk "$TMP/x" --kv-offload-disk-size 1M --kv-offload-dtype fp16
bad_flag --auth-token-file --kv-remote redis://127.0.0.1:6379 --num-kv-blocks 64
bad_flag "prefix caching" --kv-offload-dram 1M --no-prefix-caching --num-kv-blocks 64
echo "flag errors: ok"

# ---- reference: tiers off ----
pd_start ref $POOL
run "$URL" "$TMP/fwd.json" "$TMP/ref.json" "reference"
run "$URL" "$TMP/shared_more.json" "$TMP/ref_more.json" "reference"
c_ref=$(metric "$URL" '^pdserve_prefill_tokens_computed_total')
pd_stop ref

# ---- 1. three passes with DRAM + disk + Redis ----
start_redis
pd_start t1 $POOL $TIERS --kv-remote "redis://127.0.0.1:$RPORT"
run "$URL" "$TMP/fwd.json" "$TMP/t1a.json" "pass 1"
same "$TMP/ref.json" "$TMP/t1a.json" "tiers on, pass 1 (forward)"
run "$URL" "$TMP/rev.json" "$TMP/t1b.json" "pass 2"
same "$TMP/ref.json" "$TMP/t1b.json" "tiers on, pass 2 (reversed)" reversed
run "$URL" "$TMP/fwd.json" "$TMP/t1c.json" "pass 3"
same "$TMP/ref.json" "$TMP/t1c.json" "tiers on, pass 3 (forward)"
curl -sf "$URL/metrics" >"$TMP/t1.metrics"
h_dram=$(pd_metric "$TMP/t1.metrics" 'pdserve_kv_tier_hits_total{tier="dram"}')
h_disk=$(pd_metric "$TMP/t1.metrics" 'pdserve_kv_tier_hits_total{tier="disk"}')
h_redis=$(pd_metric "$TMP/t1.metrics" 'pdserve_kv_tier_hits_total{tier="redis"}')
hit_tok=$(pd_metric "$TMP/t1.metrics" 'pdserve_kv_tier_hit_tokens_total')
computed=$(pd_metric "$TMP/t1.metrics" 'pdserve_prefill_tokens_computed_total')
prompt=$(pd_metric "$TMP/t1.metrics" 'pdserve_prompt_tokens_total')
dev_hit=$(pd_metric "$TMP/t1.metrics" 'pdserve_prefix_cache_hits_total')
ev_dram=$(pd_metric "$TMP/t1.metrics" 'pdserve_kv_tier_evictions_total{tier="dram"}')
echo "hits: dram $h_dram disk $h_disk redis $h_redis; tokens: prompt $prompt computed $computed device-hit $dev_hit tier-hit $hit_tok; dram evictions $ev_dram"
[ "${h_dram:-0}" -gt 0 ] && [ "${h_disk:-0}" -gt 0 ] && [ "${h_redis:-0}" -gt 0 ] ||
  pd_fail "want hits from every tier: dram $h_dram, disk $h_disk, redis $h_redis"
[ "$ev_dram" -gt 0 ] || pd_fail "the DRAM tier never evicted: the workload does not exceed it"
[ $((computed + hit_tok)) -le "$prompt" ] ||
  pd_fail "prompt tokens $prompt < computed $computed + tier hits $hit_tok: loaded tokens were computed too"
[ "$hit_tok" -ge $((prompt / 3)) ] || pd_fail "the tiers served only $hit_tok of $prompt prompt tokens"
grep -q 'pdserve_kv_tier_load_seconds_count{tier="disk"}' "$TMP/t1.metrics" || pd_fail "no load-latency histogram"
pd_stop t1
if [ "${PDSERVE_KV_TIER_STAGING:-0}" = 1 ]; then
  # The device-cache path: whole DRAM hits end in their admitting step, their copies go out layer
  # by layer and every step's compute waited for each layer before it (none fenced at step end).
  lw=$(grep -o 'same-step copies: [0-9]* commits, [0-9]* layer-wise ([0-9]* layers a copy), [0-9]* fenced' "$TMP/t1.err")
  echo "$lw"
  set -- $(echo "$lw" | tr -cs '0-9' ' ')
  [ "${1:-0}" -gt 0 ] && [ "${2:-0}" = "$1" ] && [ "${4:-1}" = 0 ] ||
    pd_fail "want every same-step commit layer-wise and none fenced at the step's end: '$lw'"
fi

# ---- 2. restart with the disk tier: the first repeated prompt is a disk hit ----
# Write-back is best effort: under load the victims DRAM evicts faster than the disk writes are
# skipped (counted), so which of t1's pages reached the disk depends on the machine's load. The
# pages the restart reads are written by a server with the disk tier alone, and the restart waits,
# through the disk tier's put counter, until every full block of the prompt is on disk.
pd_start t2w $POOL --kv-offload-disk "$TMP/disk2" --kv-offload-disk-size 30M
run "$URL" "$TMP/first.json" "$TMP/t2w.json" "restart: the pages written"
same "$TMP/ref.json" "$TMP/t2w.json" "disk tier alone, first prompt"
disk_puts() { curl -sf "$URL/metrics" | awk '$1 == "pdserve_kv_tier_puts_total{tier=\"disk\"}" {print $2 + 0}'; }
disk_puts_at_least() { [ "$(disk_puts)" -ge "$1" ]; }
pd_wait_for 30 disk_puts_at_least 6 || pd_fail "the disk tier wrote $(disk_puts) of the prompt's 6 blocks"
pd_stop t2w
pd_start t2 $POOL --kv-offload-disk "$TMP/disk2" --kv-offload-disk-size 30M
run "$URL" "$TMP/first.json" "$TMP/t2.json" "restart"
same "$TMP/ref.json" "$TMP/t2.json" "after a restart, first prompt"
h=$(metric "$URL" '^pdserve_kv_tier_hits_total')
tok=$(metric "$URL" '^pdserve_kv_tier_hit_tokens_total')
[ "$h" -ge 5 ] && [ "$tok" -eq 80 ] || pd_fail "after a restart: $h disk hits, $tok tokens loaded (want >= 5, 80)"
echo "restart: the first prompt loaded $tok tokens from disk"
pd_stop t2

# ---- 3. flipped bytes in the disk pages: detected, recomputed, output correct ----
# The pages are written by a server with the disk tier alone, and the test waits, through the disk
# tier's put counter, until all 48 full blocks of the 8 prompts are on disk. (t1's disk, fed by the
# DRAM tier's victims, is best effort: which of these prompts' first blocks reached it depends on the
# machine's load, and a run where one had not counted "7 detected, want >= 8".) Each prompt's load
# then reads its first page, finds it bad, and stops there (the chain ends at the first block no
# tier can give): exactly 8 bad pages, nothing loaded.
python3 - "$TMP/ref.json" "$TMP/t3.ref.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); r["texts"] = r["texts"][1:9]; json.dump(r, open(sys.argv[2], "w"))
PY
pd_start t3w $POOL --kv-offload-disk "$TMP/disk3" --kv-offload-disk-size 30M
run "$URL" "$TMP/some.json" "$TMP/t3w.json" "corruption: the pages written"
same "$TMP/t3.ref.json" "$TMP/t3w.json" "disk tier alone, 8 prompts"
pd_wait_for 30 disk_puts_at_least 48 || pd_fail "the disk tier wrote $(disk_puts) of the 8 prompts' 48 blocks"
pd_stop t3w
n_files=$(ls "$TMP/disk3" | grep -c '\.kvp$')
[ "$n_files" -eq 48 ] || pd_fail "$n_files page files on disk, not the 8 prompts' 48"
python3 - "$TMP/disk3" <<'PY'
import os, sys
d = sys.argv[1]
for f in os.listdir(d):
    if f.endswith(".kvp"):
        with open(os.path.join(d, f), "r+b") as fh:
            fh.seek(5000)  # inside the payload: the header still checks, the checksum does not
            b = fh.read(4)
            fh.seek(5000)
            fh.write(bytes(x ^ 0x5A for x in b))
PY
pd_start t3 $POOL --kv-offload-disk "$TMP/disk3" --kv-offload-disk-size 30M
run "$URL" "$TMP/some.json" "$TMP/t3.json" "corrupted disk"
same "$TMP/t3.ref.json" "$TMP/t3.json" "corrupted disk pages"
bad=$(metric "$URL" '^pdserve_kv_tier_bad_pages_total')
tok=$(metric "$URL" '^pdserve_kv_tier_hit_tokens_total')
[ "$bad" -eq 8 ] && [ "$tok" -eq 0 ] || pd_fail "corrupted pages: $bad detected, $tok tokens loaded (want 8, 0)"
echo "corruption: $bad bad pages detected, nothing decoded from them"
pd_stop t3

# ---- 4. Redis killed mid-run: requests still complete ----
pd_start t4 $POOL --kv-offload-dram 2M --kv-remote "redis://127.0.0.1:$RPORT"
run "$URL" "$TMP/fwd.json" "$TMP/t4a.json" "redis before the kill"
redis_hits_above() { [ "$(metric "$URL" '^pdserve_kv_tier_hits_total\{tier="redis"\}')" -gt "$1" ]; }
h0=$(metric "$URL" '^pdserve_kv_tier_hits_total\{tier="redis"\}')
python3 "$here/disagg_client.py" "$URL" "$TMP/rev.json" "$TMP/t4b.json" --concurrency 2 --max-tokens 8 &
cli=$!
pd_wait_for 30 redis_hits_above $((h0 + 2)) || pd_fail "no Redis hits in the second run before the kill"
kill -0 $cli 2>/dev/null && when="mid-run" || when="after the run (a fast machine): the next run covers Redis down"
kill_redis
wait $cli || pd_fail "the client failed with Redis gone"
same "$TMP/ref.json" "$TMP/t4b.json" "Redis killed mid-run" reversed
run "$URL" "$TMP/some.json" "$TMP/t4c.json" "redis down"
same "$TMP/t3.ref.json" "$TMP/t4c.json" "Redis down"
miss=$(metric "$URL" '^pdserve_kv_tier_misses_total.*redis')
echo "redis killed $when: every request completed ($miss Redis misses counted)"
pd_stop t4

# ---- 5. two workers share a prefix through Redis ----
start_redis
pd_start wa $POOL --kv-remote "redis://127.0.0.1:$RPORT"
URL_A=$URL
pd_start wb $POOL --kv-remote "redis://127.0.0.1:$RPORT"
URL_B=$URL
run "$URL_A" "$TMP/shared.json" "$TMP/wa.json" "worker A"
pd_wait_for 60 sh -c "[ \$(curl -sf '$URL_A/metrics' | awk '/^pdserve_kv_tier_puts_total/ {s+=\$2} END {print s+0}') -ge 10 ]" ||
  pd_fail "worker A never wrote its prefix to Redis"
run "$URL_B" "$TMP/shared_more.json" "$TMP/wb.json" "worker B"
same "$TMP/ref_more.json" "$TMP/wb.json" "worker B with worker A's prefix"
cb=$(metric "$URL_B" '^pdserve_prefill_tokens_computed_total')
tb=$(metric "$URL_B" '^pdserve_kv_tier_hit_tokens_total')
[ "$tb" -eq 160 ] && [ "$cb" -eq 40 ] || pd_fail "worker B: $tb tokens from the pool, $cb computed (want 160, 40)"
echo "pool: worker B loaded $tb prompt tokens computed by worker A and computed only $cb"
# A prefill worker consults the pool before computing: a decode worker hands the same prompt to a
# prefill worker on the pool, which loads the 192 tokens workers A and B wrote there (A: 10 blocks,
# B: the 2 full blocks of its new part) and computes the last 8. B's two writes go out on its tier
# thread after its reply: waited for (bounded), as A's were.
pd_wait_for 60 sh -c "[ \$(curl -sf '$URL_B/metrics' | awk '/^pdserve_kv_tier_puts_total/ {s+=\$2} END {print s+0}') -ge 2 ]" ||
  pd_fail "worker B never wrote the 2 new blocks of its prompt to Redis"
pd_start pw --role prefill --kv-port 0 --num-kv-blocks 64 --auth-token-file "$TMP/token" --kv-remote "redis://127.0.0.1:$RPORT"
URL_P=$URL
kv=$(grep -o 'KV port [0-9.]*:[0-9]*' "$TMP/pw.out" | head -1 | awk '{print $3}')
[ -n "$kv" ] || pd_fail "the prefill worker did not print its KV port"
pd_start dw --role decode --prefill "$kv" --disagg-min-tokens 1 --num-kv-blocks 64 --auth-token-file "$TMP/token"
pd_wait_for 30 sh -c "curl -sf '$URL/metrics' | grep -q '^pdserve_kv_prefill_workers_healthy 1'" || pd_fail "decode worker never connected"
run "$URL" "$TMP/shared_more.json" "$TMP/dw.json" "disaggregated"
same "$TMP/ref_more.json" "$TMP/dw.json" "prefill worker with the pool"
[ "$(metric "$URL" '^pdserve_kv_handoffs_total')" -eq 1 ] || pd_fail "the prompt was not handed off"
cp=$(metric "$URL_P" '^pdserve_prefill_tokens_computed_total')
tp=$(metric "$URL_P" '^pdserve_kv_tier_hit_tokens_total')
[ "$tp" -eq 192 ] && [ "$cp" -eq 8 ] || pd_fail "prefill worker: $tp tokens from the pool, $cp computed (want 192, 8)"
echo "pool: the prefill worker loaded $tp tokens from the pool and computed $cp"
pd_stop dw
pd_stop pw
# The router sees the tiers: KV events with a tier feed its index, /status.json lists them.
"$PD_BIN" router --host 127.0.0.1 --port 0 --worker "$URL_A" --worker "$URL_B" --auth-token-file "$TMP/token" \
  --routing kv >"$TMP/router.out" 2>"$TMP/router.err" &
echo $! >"$TMP/router.pid"
pd_wait_for 20 grep -q 'http://' "$TMP/router.out" || { cat "$TMP/router.err" >&2; pd_fail "router did not start"; }
RURL=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/router.out" | head -1)
pd_wait_for 20 sh -c "curl -sf '$RURL/status.json' | grep -q '\"tier_hit_tokens\":160'" || pd_fail "router /status.json shows no KV tiers"
curl -sf "$RURL/status.json" | grep -q '"name":"redis"' || pd_fail "router /status.json does not name the Redis tier"
curl -sf "$RURL/status" | grep -q 'redis' || pd_fail "router /status page does not show the tiers"
kill "$(cat "$TMP/router.pid")"; wait "$(cat "$TMP/router.pid")" 2>/dev/null; rm -f "$TMP/router.pid"
echo "router: /status shows the workers' KV tiers"
pd_stop wa
pd_stop wb
kill_redis
echo "PASS test_kv_tiers"
