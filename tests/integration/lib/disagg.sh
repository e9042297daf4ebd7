# disagg.sh — helpers for the disaggregation tests (POSIX sh; sourced after server.sh and pd_setup):
# test_disagg.sh, test_disagg_ucx.sh, test_kv_faults.sh, test_spec.sh.
#   dg_prompts OUT N SEED LEN...  the 6 golden prompts of kjv-llama-6m, then slices of golden
#                                 prompt 3 (lengths drawn from LEN... with random.Random(SEED)) up
#                                 to N prompts, as a JSON list of token-id lists (without the
#                                 golden file: slices of 10..309)
#   dg_token                      the KV connections' shared secret in $TMP/token (mode 600)
#   dg_metric URL NAME_REGEX      sum of the /metrics samples whose name (+ labels) matches
#   dg_compare OUT.json LABEL     OUT's texts equal $DG_REF's (default $TMP/ref.json), no request
#                                 failed; DG_REF_WHAT names the reference in messages ("colocated")
#   dg_reference NAME CONCURRENCY MAX_TOKENS FLAGS...
#                                 starts server NAME (`serve` FLAGS), runs the prompts through it
#                                 (greedy) into $TMP/ref.json; the server keeps running
#   dg_start_prefill NAME [FLAGS] a prefill worker (--kv-port 0, 2048 blocks, the token); sets
#                                 $KV (host:port), $KVPORT and $URL
#   dg_start_decode NAME TRANSPORT [FLAGS]
#                                 a decode worker for the prefill worker at $KV (hands off every
#                                 prompt, 20 s handoff timeout, the token; DG_DECODE_BLOCKS
#                                 blocks, default 2048); sets $URL
#   dg_wait_connected URL         waits (bounded) until that decode worker's prefill worker is
#                                 connected (pdserve_kv_prefill_workers_healthy 1)
#   dg_start_pair NAME TRANSPORT [PREFILL FLAGS]
#                                 prefill_NAME + decode_NAME (TRANSPORT), connected; $URL = decode
# The two checks every transport's test runs (the prompts in $TMP/prompts.json, the reference in
# $TMP/ref.json, 24 tokens each, tests/integration/disagg_client.py from $here):
#   dg_check_corrupt NAME TRANSPORT  a pair whose prefill worker corrupts every 3rd transfer
#                                 (--debug-corrupt-kv 3): outputs identical, >= 1 fallback counted
#                                 with reason "checksum" (never decoded from corrupted KV)
#   dg_check_kill NAME TRANSPORT  kill -9 of the prefill worker after >= 4 handoffs, 32 requests in
#                                 flight: every request completes with identical output

dg_prompts() {
  out=$1 n=$2 seed=$3; shift 3
  python3 - "$out" "$n" "$seed" "${PD_MODELS_DIR:-$repo/../shared/models}" "$@" <<'PY'
import json, os, random, sys
out, n, seed, shared = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lens = [int(x) for x in sys.argv[5:]]
g = os.path.join(shared, "golden", "kjv-llama-6m.json")
prompts = [p["prompt_ids"] for p in json.load(open(g))["prompts"]] if os.path.exists(g) else []
base = prompts[3] if len(prompts) > 3 else list(range(10, 310))
rng = random.Random(seed)
while len(prompts) < n:
    k = rng.choice(lens)
    s = rng.randrange(0, max(1, len(base) - k))
    prompts.append(base[s:s + k])
json.dump(prompts, open(out, "w"))
PY
}

dg_token() {
  (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/token")
}

dg_metric() {
  curl -sf "$1/metrics" | awk -v re="$2" '$1 ~ re {s += $2} END {print s + 0}'
}

dg_compare() {
  python3 - "${DG_REF:-$TMP/ref.json}" "$1" "$2" "${DG_REF_WHAT:-colocated}" <<'PY' || return 1
import json, sys
ref, got, label, what = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4]
if got["errors"]:
    sys.exit("FAIL %s: %d requests failed: %s" % (label, got["errors"], got["error_list"]))
bad = [i for i, (a, b) in enumerate(zip(ref["texts"], got["texts"])) if a != b]
if bad:
    sys.exit("FAIL %s: %d of %d outputs differ from %s (first: %d)" % (label, len(bad), len(ref["texts"]), what, bad[0]))
print("ok   %s: %d outputs identical to %s" % (label, len(ref["texts"]), what))
PY
}

dg_reference() {
  dg_n=$1 dg_cc=$2 dg_mt=$3; shift 3
  pd_start "$dg_n" "$@"
  python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/ref.json" --concurrency "$dg_cc" \
    --max-tokens "$dg_mt" || pd_fail "reference run failed"
}

dg_start_prefill() {
  dg_n=$1; shift
  # a name used before: drop its old output first, or pd_start may read the old URL before the new
  # process truncated the file
  rm -f "$TMP/$dg_n.out"
  pd_start "$dg_n" --role prefill --kv-port 0 --num-kv-blocks 2048 --auth-token-file "$TMP/token" "$@"
  KV=$(grep -o 'KV port [0-9.]*:[0-9]*' "$TMP/$dg_n.out" | head -1 | awk '{print $3}')
  [ -n "$KV" ] || pd_fail "$dg_n did not print its KV port"
  KVPORT=${KV##*:}
}

dg_start_decode() {
  dg_n=$1 dg_tr=$2; shift 2
  rm -f "$TMP/$dg_n.out"
  pd_start "$dg_n" --role decode --prefill "$KV" --kv-transport "$dg_tr" --disagg-min-tokens 1 \
    --disagg-timeout-ms 20000 --num-kv-blocks "${DG_DECODE_BLOCKS:-2048}" --auth-token-file "$TMP/token" "$@"
}

dg_wait_connected() {
  pd_wait_for 30 sh -c "curl -sf '$1/metrics' | grep -q '^pdserve_kv_prefill_workers_healthy 1'" ||
    pd_fail "the decode worker at $1 never connected to its prefill worker"
}

dg_start_pair() {
  dg_p=$1 dg_t=$2; shift 2
  dg_start_prefill "prefill_$dg_p" "$@"
  dg_start_decode "decode_$dg_p" "$dg_t"
  dg_wait_connected "$URL"
}

dg_check_corrupt() {
  dg_start_pair "$1" "$2" --debug-corrupt-kv 3
  python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/corrupt_$1.json" --concurrency 16 --max-tokens 24
  dg_compare "$TMP/corrupt_$1.json" "corrupt ($2)" || pd_fail "corrupted transfers changed outputs ($2)"
  dg_c=$(dg_metric "$URL" 'pdserve_kv_handoff_fallbacks_total.*reason="checksum"')
  [ "$dg_c" -ge 1 ] || pd_fail "no checksum fallback counted ($2)"
  echo "corrupt ($2): $dg_c transfers caught by checksum"
  pd_stop "decode_$1"
  pd_stop "prefill_$1"
}

dg_check_kill() {
  dg_start_pair "$1" "$2"
  python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/kill_$1.json" --concurrency 32 --max-tokens 24 &
  dg_cpid=$!
  pd_wait_for 30 sh -c "[ \$(curl -sf '$URL/metrics' | awk '/^pdserve_kv_handoffs_total/ {print \$2+0}') -ge 4 ]" ||
    pd_fail "no handoff happened before the kill ($2)"
  kill -9 "$(cat "$TMP/prefill_$1.pid")"
  rm -f "$TMP/prefill_$1.pid"
  wait $dg_cpid
  dg_compare "$TMP/kill_$1.json" "killed prefill ($2)" ||
    pd_fail "requests failed or changed after the prefill worker died ($2)"
  dg_d=$(dg_metric "$URL" 'pdserve_kv_handoff_fallbacks_total.*reason="(worker_died|timeout|unavailable)"')
  echo "killed prefill ($2): every request completed; $dg_d prompts fell back to local prefill"
  pd_stop "decode_$1"
}
