#!/bin/sh
# Speculative decoding through the server (CPU): greedy completions of the 6 golden prompts and
# 26 mixed-length slices of held-out text must be byte-identical with speculation off and on —
# draft model (kjv-llama-1m drafting for kjv-llama-6m), ngram and lookahead — colocated, and
# through `pdserve run` (prefill worker + decode worker + router: the decode worker prefills the
# draft locally after each KV handoff). /metrics shows the work per method and a response carries
# usage.speculative; a draft with another tokenizer is refused at start with a clear error.
. "$(dirname "$0")/lib/server.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is needed"
here=$(cd "$(dirname "$0")" && pwd)
shared="${PD_MODELS_DIR:-$repo/../shared/models}"
DRAFT="$shared/kjv-llama-1m"
[ -e "$DRAFT/config.json" ] || pd_fail "draft model kjv-llama-1m not found in $shared"

. "$(dirname "$0")/lib/disagg.sh"
[ -e "$shared/golden/kjv-llama-6m.json" ] || pd_fail "golden prompts of kjv-llama-6m not found in $shared"
dg_prompts "$TMP/prompts.json" 32 11 3 17 40 90 150
DG_REF_WHAT="speculation off"  # (dg_compare's reference: $TMP/ref.json)

dg_reference ref 8 24 --num-kv-blocks 1024
pd_stop ref

run_method() {  # run_method NAME METHOD MUST_DRAFT(0|1) FLAGS...
  name=$1 m=$2 must=$3; shift 3
  pd_start "$name" --num-kv-blocks 1024 --speculative-method "$m" "$@"
  python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/$name.json" --concurrency 8 --max-tokens 24 ||
    pd_fail "$name run failed"
  dg_compare "$TMP/$name.json" "$name" || pd_fail "$name: outputs differ"
  d=$(dg_metric "$URL" "^pdserve_spec_draft_tokens_total\\{method=\"$m\"\\}")
  a=$(dg_metric "$URL" "^pdserve_spec_accepted_tokens_total\\{method=\"$m\"\\}")
  echo "     $name: $d draft tokens verified, $a accepted"
  [ "$must" = 0 ] || [ "$d" -gt 0 ] || pd_fail "$name: /metrics shows no draft tokens"
  [ "$a" -le "$d" ] || pd_fail "$name: more accepted than drafted"
}

run_method draft draft 1 --speculative-model "$DRAFT" --num-speculative-tokens 4 --speculative-fixed
# A response carries the per-request figures (usage.speculative).
curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"And God said","max_tokens":24,"temperature":0,"ignore_eos":true}' >"$TMP/usage.json" ||
  pd_fail "completion failed"
python3 - "$TMP/usage.json" <<'PY' || pd_fail "usage.speculative missing or wrong"
import json, sys
u = json.load(open(sys.argv[1]))["usage"]["speculative"]
assert u["method"] == "draft", u
assert u["draft_tokens"] > 0 and 0 <= u["accepted_tokens"] <= u["draft_tokens"], u
assert u["verify_steps"] > 0 and u["mean_accepted_length"] >= 1, u
print("ok   usage.speculative: %s" % u)
PY
curl -sf "$URL/metrics" | grep -q '^pdserve_spec_mean_accepted_length{method="draft"} [1-9]' ||
  pd_fail "/metrics: no mean accepted length for draft"
pd_stop draft
# Adaptive lengths: on a CPU a verify step costs about its tokens, so the policy may draft little.
run_method draft_adaptive draft 0 --speculative-model "$DRAFT" --num-speculative-tokens 4
pd_stop draft_adaptive
run_method ngram ngram 1 --num-speculative-tokens 4 --speculative-fixed
pd_stop ngram
run_method lookahead lookahead 1 --speculative-fixed --lookahead-window 6 --lookahead-ngram 3
pd_stop lookahead

# A draft with another tokenizer is refused at start (every shared model has the same one: make a
# copy of the draft whose tokenizer swaps two ids).
mkdir "$TMP/baddraft"
for f in config.json generation_config.json model.safetensors tokenizer_config.json special_tokens_map.json; do
  ln -s "$DRAFT/$f" "$TMP/baddraft/$f"
done
python3 - "$DRAFT/tokenizer.json" "$TMP/baddraft/tokenizer.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
v = t["model"]["vocab"]
a = next(k for k, i in v.items() if i == 300)
b = next(k for k, i in v.items() if i == 301)
v[a], v[b] = 301, 300
json.dump(t, open(sys.argv[2], "w"))
PY
if "$PD_BIN" serve --model "$MODEL" --port 0 --num-kv-blocks 64 --speculative-model "$TMP/baddraft" \
    >"$TMP/bad.out" 2>"$TMP/bad.err"; then
  pd_fail "a draft with another tokenizer was accepted"
fi
grep -q 'tokenizer' "$TMP/bad.err" || pd_fail "no clear error for a mismatched draft: $(cat "$TMP/bad.err")"
echo "ok   mismatched draft tokenizer refused: $(grep -o 'speculative-model.*' "$TMP/bad.err" | head -1)"

# Disaggregated (`pdserve run`: prefill worker, decode worker with the draft, router). Every prompt
# is handed off (--disagg-min-tokens 1); the decode worker prefills the draft itself.
"$PD_BIN" run --model "$MODEL" --port 0 --num-kv-blocks 1024 --disagg-min-tokens 1 \
  --speculative-model "$DRAFT" --num-speculative-tokens 4 --speculative-fixed >"$TMP/run.out" 2>"$TMP/run.err" &
echo $! >"$TMP/run.pid"
pd_wait_for 180 grep -qi 'serving on http://' "$TMP/run.out" || { cat "$TMP/run.err" >&2; pd_fail "pdserve run did not start"; }
RURL=$(grep -o 'router http://[0-9.]*:[0-9]*' "$TMP/run.out" | head -1 | awk '{print $2}')
DURL=$(grep -o 'decode worker http://[0-9.]*:[0-9]*' "$TMP/run.out" | head -1 | awk '{print $3}')
[ -n "$RURL" ] && [ -n "$DURL" ] || pd_fail "pdserve run printed no router / decode URL: $(cat "$TMP/run.out")"
python3 "$here/disagg_client.py" "$RURL" "$TMP/prompts.json" "$TMP/run.json" --concurrency 8 --max-tokens 24 ||
  pd_fail "pdserve run: requests failed"
dg_compare "$TMP/run.json" "pdserve run (disaggregated, draft)" || pd_fail "pdserve run: outputs differ"
h=$(dg_metric "$DURL" '^pdserve_kv_handoffs_total')
d=$(dg_metric "$DURL" '^pdserve_spec_draft_tokens_total\{method="draft"\}')
a=$(dg_metric "$DURL" '^pdserve_spec_accepted_tokens_total\{method="draft"\}')
echo "     decode worker: $h handoffs, $d draft tokens verified, $a accepted"
[ "$h" -gt 0 ] || pd_fail "pdserve run: no KV handoffs"
[ "$d" -gt 0 ] && [ "$a" -gt 0 ] || pd_fail "pdserve run: the decode worker did not speculate ($d drafted, $a accepted)"
kill -TERM "$(cat "$TMP/run.pid")"
wait "$(cat "$TMP/run.pid")" 2>/dev/null
rm -f "$TMP/run.pid"
echo "ok   speculative decoding: byte-identical greedy output colocated and disaggregated"
