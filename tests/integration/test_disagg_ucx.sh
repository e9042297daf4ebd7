#!/bin/sh
# test_disagg_ucx.sh — the ucx KV transport (--kv-transport ucx, libucx) on loopback (CPU): a
# prefill worker puts the KV straight into the decode worker's UCX-registered pool. Checks, against
# a colocated `--role both` server, for UCX_TLS=tcp,self and UCX_TLS=tcp,sm,self (sm alone
# cannot reach the other process in our containers: "Destination is unreachable"):
#   1. greedy outputs are identical for the golden prompts and 64 concurrent mixed-length requests,
#      /metrics shows >= 64 handoffs and no fallback;
#   2. a corrupted transfer (--debug-corrupt-kv: one flipped bit put remotely) is caught by the
#      checksum and recomputed;
#   3. kill -9 of the prefill worker during a load: every request still completes correctly.
. "$(dirname "$0")/lib/server.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is needed"
here=$(cd "$(dirname "$0")" && pwd)

# Prompts: the 6 golden prompts + 58 mixed-length slices of the held-out text.
python3 - "$MODEL" "$TMP/prompts.json" "${PD_MODELS_DIR:-$repo/../shared/models}" <<'PY'
import json, random, sys, os
model, out, shared = sys.argv[1:4]
g = os.path.join(shared, "golden", "kjv-llama-6m.json")
prompts = [p["prompt_ids"] for p in json.load(open(g))["prompts"]] if os.path.exists(g) else []
base = prompts[3] if len(prompts) > 3 else list(range(10, 310))
rng = random.Random(7)
while len(prompts) < 64:
    n = rng.choice([3, 17, 64, 90, 150, 250])
    s = rng.randrange(0, max(1, len(base) - n))
    prompts.append(base[s:s + n])
json.dump(prompts, open(out, "w"))
PY

# The KV connections' shared secret (the workers refuse to start without one).
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/token")
metric() {  # metric URL NAME_REGEX: sums the matching samples
  curl -sf "$1/metrics" | awk -v re="$2" '$1 ~ re {s += $2} END {print s + 0}'
}

pd_start both --num-kv-blocks 2048
python3 "$here/disagg_client.py" "$URL_both" "$TMP/prompts.json" "$TMP/ref.json" --concurrency 16 --max-tokens 24 ||
  pd_fail "reference run failed"

start_pair() {  # start_pair TRANSPORT [prefill flags...]
  tr=$1; shift
  pd_start prefill_$tr --role prefill --kv-port 0 --num-kv-blocks 2048 --auth-token-file "$TMP/token" "$@"
  kv=$(grep -o 'KV port [0-9.]*:[0-9]*' "$TMP/prefill_$tr.out" | head -1 | awk '{print $3}')
  [ -n "$kv" ] || pd_fail "prefill worker did not print its KV port"
  pd_start decode_$tr --role decode --prefill "$kv" --kv-transport ucx --disagg-min-tokens 1 \
    --disagg-timeout-ms 20000 --num-kv-blocks 2048 --auth-token-file "$TMP/token"
  # wait until the decode worker is connected to the prefill worker
  pd_wait_for 30 sh -c "curl -sf '$URL/metrics' | grep -q '^pdserve_kv_prefill_workers_healthy 1'" ||
    pd_fail "$tr: decode worker never connected to the prefill worker"
}

compare() {  # compare OUT.json LABEL
  python3 - "$TMP/ref.json" "$1" "$2" <<'PY' || exit 1
import json, sys
ref, got, label = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
if got["errors"]:
    sys.exit("FAIL %s: %d requests failed: %s" % (label, got["errors"], got["error_list"]))
bad = [i for i, (a, b) in enumerate(zip(ref["texts"], got["texts"])) if a != b]
if bad:
    sys.exit("FAIL %s: %d of %d outputs differ from colocated (first: %d)" % (label, len(bad), len(ref["texts"]), bad[0]))
print("%s: %d outputs identical to colocated" % (label, len(ref["texts"])))
PY
}

for tls in tcp,self tcp,sm,self; do
  export UCX_TLS=$tls
  tr=ucx_$(echo $tls | tr , _)
  start_pair $tr
  python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/$tr.json" --concurrency 16 --max-tokens 24 ||
    pd_fail "$tr run failed"
  compare "$TMP/$tr.json" "$tr" || pd_fail "$tr outputs differ"
  h=$(metric "$URL" '^pdserve_kv_handoffs_total')
  f=$(metric "$URL" '^pdserve_kv_handoff_fallbacks_total')
  b=$(metric "$URL" '^pdserve_kv_handoff_bytes_total')
  [ "$h" -ge 64 ] || pd_fail "$tr: expected >= 64 handoffs, /metrics says $h"
  [ "$f" -eq 0 ] || pd_fail "$tr: expected no recomputed prompts, /metrics says $f fallbacks"
  echo "$tr: $h handoffs, $b KV bytes, 0 fallbacks"
  pd_stop decode_$tr
  pd_stop prefill_$tr
done
export UCX_TLS=tcp,self

start_pair ucx_corrupt --debug-corrupt-kv 3
python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/corrupt.json" --concurrency 16 --max-tokens 24
compare "$TMP/corrupt.json" "corrupt" || pd_fail "corrupted transfers changed outputs"
c=$(metric "$URL" 'pdserve_kv_handoff_fallbacks_total.*reason="checksum"')
[ "$c" -ge 1 ] || pd_fail "no checksum fallback counted"
echo "corrupt: $c transfers caught by checksum"
pd_stop decode_ucx_corrupt
pd_stop prefill_ucx_corrupt

start_pair ucx_kill
python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/kill.json" --concurrency 32 --max-tokens 24 &
cpid=$!
pd_wait_for 30 sh -c "[ \$(curl -sf '$URL/metrics' | awk '/^pdserve_kv_handoffs_total/ {print \$2+0}') -ge 4 ]" ||
  pd_fail "no handoff happened before the kill"
kill -9 "$(cat "$TMP/prefill_ucx_kill.pid")"
wait $cpid
compare "$TMP/kill.json" "killed prefill" || pd_fail "requests failed or changed after the prefill worker died"
d=$(metric "$URL" 'pdserve_kv_handoff_fallbacks_total.*reason="(worker_died|timeout|unavailable)"')
echo "killed prefill: every request completed; $d prompts fell back to local prefill"
pd_stop decode_ucx_kill
echo "PASS test_disagg_ucx"
