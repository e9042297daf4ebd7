# supervise.sh — helpers for the shutdown / supervisor tests (POSIX sh; sourced after server.sh).
#   sv_prompts OUT N SEED        N distinct token-id prompts of 70..150 tokens (>= the default
#                                --disagg-min-tokens 64, so `run` hands them off), no two sharing
#                                a first KV block
#   sv_streams NAME URL PROMPTS MAX_TOKENS [READY_AFTER]
#                                starts tests/integration/stream_client.py in the background
#                                (pid in $TMP/NAME.cpid, result in $TMP/NAME.json, ready file
#                                $TMP/NAME.ready once READY_AFTER streams have text)
#   sv_wait_file FILE SECS       waits (bounded) for a file to exist
#   sv_wait_exit PID SECS        waits (bounded) for a child process to exit; sets $SV_RC
#   sv_check_streams NAME N [REF.json]
#                                all N streams ended with [DONE] and finish "length", no error,
#                                texts equal to REF's (when given)
#   sv_check_draining URL        /health answers 503 "draining" (polled, bounded: the signal is
#                                asynchronous), then a new request gets 503 + Retry-After with an
#                                OpenAI error body
#   sv_metric URL NAME           sum of a Prometheus metric's samples (any labels)

sv_prompts() {
  python3 - "$MODEL" "$1" "$2" "$3" "${PD_MODELS_DIR:-$repo/../shared/models}" <<'PY'
import json, os, random, sys
model, out, n, seed, shared = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
g = os.path.join(shared, "golden", "kjv-llama-6m.json")
base = json.load(open(g))["prompts"][3]["prompt_ids"] if os.path.exists(g) else list(range(10, 310))
rng = random.Random(seed)
prompts = []
for i in range(n):
    k = rng.randrange(70, 151)
    s = rng.randrange(0, max(1, len(base) - k))
    # a distinct first token per prompt: no shared prefix blocks between prompts or runs
    prompts.append([100 + seed * 64 + i] + base[s:s + k - 1])
json.dump(prompts, open(out, "w"))
PY
}

sv_streams() {
  _n=$1 _url=$2 _p=$3 _mt=$4
  _ra=${5:-$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))))" "$_p")}
  rm -f "$TMP/$_n.ready" "$TMP/$_n.json"
  python3 "$here/stream_client.py" "$_url" "$_p" "$TMP/$_n.json" --max-tokens "$_mt" \
    --ready "$TMP/$_n.ready" --ready-after "$_ra" &
  echo $! >"$TMP/$_n.cpid"
}

sv_wait_file() {
  _end=$(( $(date +%s) + $2 ))
  while [ ! -e "$1" ]; do
    [ "$(date +%s)" -ge "$_end" ] && return 1
    sleep 0.05
  done
  return 0
}

sv_wait_exit() {
  _end=$(( $(date +%s) + $2 ))
  while kill -0 "$1" 2>/dev/null; do
    # a zombie has exited: `wait` collects it
    [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" = Z ] && break
    [ "$(date +%s)" -ge "$_end" ] && return 1
    sleep 0.1
  done
  wait "$1"
  SV_RC=$?
  return 0
}

sv_check_streams() {
  _n=$1 _want=$2 _ref=${3:-}
  _cpid=$(cat "$TMP/$_n.cpid")
  sv_wait_exit "$_cpid" 330 || pd_fail "$_n: the stream client did not finish"
  rm -f "$TMP/$_n.cpid"
  [ -e "$TMP/$_n.json" ] || pd_fail "$_n: the stream client wrote no result"
  python3 - "$TMP/$_n.json" "$_want" "$_n" "$_ref" <<'PY' || exit 1
import json, sys
got, want, label, ref = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3], sys.argv[4]
bad = [i for i in range(len(got["texts"])) if not (got["done"][i] and got["finish"][i] == "length" and got["errors"][i] is None)]
if bad or got["n_ok"] != want:
    i = bad[0] if bad else 0
    sys.exit("FAIL %s: %d of %d streams complete; stream %d: done=%s finish=%s error=%s" % (
        label, got["n_ok"], want, i, got["done"][i], got["finish"][i], got["errors"][i]))
if ref:
    r = json.load(open(ref))
    diff = [i for i, (a, b) in enumerate(zip(r["texts"], got["texts"])) if a != b]
    if diff:
        sys.exit("FAIL %s: %d of %d texts differ from the undisturbed run (first: %d)" % (label, len(diff), want, diff[0]))
print("%s: %d/%d streams complete%s" % (label, got["n_ok"], want, ", texts identical to the undisturbed run" if ref else ""))
PY
}

sv_check_draining() {
  _url=$1
  _end=$(( $(date +%s) + 10 ))
  while :; do
    _code=$(curl -s -o "$TMP/health.body" -w '%{http_code}' "$_url/health")
    [ "$_code" = 503 ] && break
    [ "$(date +%s)" -ge "$_end" ] && pd_fail "$_url/health still answers $_code 10 s after the signal"
    sleep 0.05
  done
  grep -q '"draining"' "$TMP/health.body" || pd_fail "/health 503 body does not say draining: $(cat "$TMP/health.body")"
  _code=$(curl -s -D "$TMP/late.hdr" -o "$TMP/late.body" -w '%{http_code}' "$_url/v1/completions" \
    -H 'Content-Type: application/json' -d '{"prompt":"And God said","max_tokens":4}')
  [ "$_code" = 503 ] || pd_fail "a request sent while draining got HTTP $_code, not 503"
  grep -qi '^Retry-After: [0-9]' "$TMP/late.hdr" || pd_fail "the 503 while draining has no Retry-After header"
  grep -q '"error":{' "$TMP/late.body" || pd_fail "the 503 body is not an OpenAI error: $(cat "$TMP/late.body")"
  echo "  draining: /health 503 $(cat "$TMP/health.body"), new request 503 + Retry-After"
}

sv_metric() {
  curl -sf "$1/metrics" | awk -v n="$2" '$1 == n || index($1, n "{") == 1 {s += $2} END {print s + 0}'
}
