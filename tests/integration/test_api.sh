#!/bin/sh
# test_api.sh — black-box tests of `pdserve serve` over HTTP on 127.0.0.1 (exit 0 = pass):
#   1. endpoints: /health, /v1/models, /metrics, completions and chat, streaming and not, usage
#      with cached tokens on a repeated prompt, stop strings, n > 1, logprobs
#   2. every bad-input case: HTTP status + OpenAI error JSON (type, param), 404/405/413, 503
#   3. greedy outputs identical: prefix caching on/off, chunk budgets 16/64/2048, alone vs among
#      32 concurrent requests, and under memory pressure (tiny KV pool → preemption)
#   4. 400 idle connections + 16 open streams do not stop a request from being served;
#      soak: 500 requests from 64 concurrent clients, some disconnecting mid-stream; afterwards
#      the KV pool is back to its initial free count and the server still answers
#   5. --router: the worker registers with a router, serves through it, deregisters at exit
#   6. SIGTERM: clean exit with status 0
# Needs curl and node (the load client is tests/integration/js/load.mjs, no npm packages).
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
command -v curl >/dev/null || pd_fail "curl is required"
command -v node >/dev/null || pd_fail "node is required"
LOAD="node $here/js/load.mjs"
n_checks=0

# ---- servers --------------------------------------------------------------------------------
# A: defaults (prefix caching, budget 2048). B: no prefix caching, budget 16. C: budget 64.
# D: memory pressure, 40 blocks of 16 tokens. E: one sequence, one waiting slot (503s), and the
# remaining serve flags (KV size in bytes, srpt, a shorter context, no chunked prefill).
pd_start A --num-kv-blocks 1024 --served-model-name kjv
pd_start B --num-kv-blocks 1024 --served-model-name kjv --no-prefix-caching --max-num-batched-tokens 16
pd_start C --num-kv-blocks 1024 --served-model-name kjv --max-num-batched-tokens 64
pd_start D --num-kv-blocks 40 --served-model-name kjv
pd_start E --kv-cache-memory 16M --policy srpt --max-model-len 512 --no-chunked-prefill --served-model-name kjv \
  --max-num-seqs 1 --max-waiting 1
URL=$URL_A
echo "servers up: A=$URL_A B=$URL_B C=$URL_C D=$URL_D E=$URL_E"

ok() { n_checks=$((n_checks+1)); }
# req METHOD PATH [BODY] → $TMP/body, echoes the HTTP status
req() {
  if [ -n "${3:-}" ]; then
    curl -s -o "$TMP/body" -D "$TMP/headers" -w '%{http_code}' -X "$1" -H 'Content-Type: application/json' --data-binary "$3" "$URL$2"
  else
    curl -s -o "$TMP/body" -D "$TMP/headers" -w '%{http_code}' -X "$1" "$URL$2"
  fi
}
has() { grep -q -- "$1" "$TMP/body" || pd_fail "$2: body lacks $1: $(head -c 600 "$TMP/body")"; ok; }
# bad WANT_STATUS PARAM PATH BODY — PARAM "null" means "param":null
bad() {
  code=$(req POST "$3" "$4")
  [ "$code" = "$1" ] || pd_fail "POST $3 $4: status $code, want $1: $(head -c 400 "$TMP/body")"
  grep -q '^{"error":{"message":"' "$TMP/body" || pd_fail "POST $3 $4: not an OpenAI error: $(cat "$TMP/body")"
  if [ "$2" = null ]; then p='"param":null'; else p="\"param\":\"$2\""; fi
  grep -q "$p" "$TMP/body" || pd_fail "POST $3 $4: want $p in $(cat "$TMP/body")"
  grep -q '"code":' "$TMP/body" || pd_fail "no code field"
  ok
}

# ---- 0. `pdserve run`: the embedded default answers its own sample request ----------------------
"$PD_BIN" run --model "$MODEL" --port 0 --num-kv-blocks 256 --exit-after-sample >"$TMP/run.out" 2>"$TMP/run.err" ||
  pd_fail "pdserve run failed: $(cat "$TMP/run.err")"
grep -q '^answer: ..' "$TMP/run.out" || pd_fail "pdserve run printed no answer: $(cat "$TMP/run.out")"
grep -q 'curl http://127.0.0.1:[0-9]*/v1/chat/completions' "$TMP/run.out" || pd_fail "pdserve run printed no curl example"
echo "ok   pdserve run answers its sample request"

# ---- 1. endpoints ---------------------------------------------------------------------------
[ "$(req GET /health)" = 200 ] && has '{"status":"ok"}' health
[ "$(req GET /v1/models)" = 200 ] || pd_fail "/v1/models"
has '"object":"list"' models; has '"id":"kjv"' models; has '"max_model_len":2048' models

code=$(req POST /v1/completions '{"model":"kjv","prompt":"In the beginning God","max_tokens":12,"temperature":0}')
[ "$code" = 200 ] || pd_fail "completion: $code $(cat "$TMP/body")"
has '"object":"text_completion"' completion; has '"finish_reason":"length"' completion
has '"completion_tokens":12' completion; has '"id":"cmpl-' completion; has '"model":"kjv"' completion

code=$(req POST /v1/chat/completions '{"messages":[{"role":"user","content":"In the beginning"}],"max_tokens":10,"temperature":0}')
[ "$code" = 200 ] || pd_fail "chat: $code $(cat "$TMP/body")"
has '"object":"chat.completion"' chat; has '"message":{"role":"assistant","content":"' chat
has '"id":"chatcmpl-' chat; has '"prompt_tokens_details":{"cached_tokens":' chat

# Streaming chat: role first, content deltas, a finish chunk, the usage chunk, [DONE].
code=$(req POST /v1/chat/completions '{"messages":[{"role":"user","content":"And God said"}],"max_tokens":6,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}')
[ "$code" = 200 ] || pd_fail "chat stream $code"
grep -qi '^content-type: text/event-stream' "$TMP/headers" || pd_fail "no SSE content type"
head -1 "$TMP/body" | grep -q '^data: {.*"object":"chat.completion.chunk".*"delta":{"role":"assistant","content":""}' || pd_fail "first chunk: $(head -1 "$TMP/body")"
[ "$(grep -c '"delta":{"content":' "$TMP/body")" -ge 1 ] || pd_fail "no content deltas"
grep -q '"delta":{},"logprobs":null,"finish_reason":"length"' "$TMP/body" || pd_fail "no finish chunk"
grep -q '"choices":\[\],"usage":{"prompt_tokens":[0-9]*,"completion_tokens":6,' "$TMP/body" || pd_fail "no usage chunk"
[ "$(tail -2 "$TMP/body" | head -1)" = "data: [DONE]" ] || pd_fail "stream does not end with [DONE]"
ok

# Streaming completion text equals the non-streaming text (greedy).
body='{"prompt":"Jesus wept","max_tokens":16,"temperature":0}'
req POST /v1/completions "$body" >/dev/null
whole=$(node -e 'const o=JSON.parse(require("fs").readFileSync(process.argv[1]));process.stdout.write(o.choices[0].text)' "$TMP/body")
req POST /v1/completions '{"prompt":"Jesus wept","max_tokens":16,"temperature":0,"stream":true}' >/dev/null
streamed=$(node -e 'let t="";for(const l of require("fs").readFileSync(process.argv[1],"utf8").split("\n\n")){if(!l.startsWith("data: {"))continue;for(const c of JSON.parse(l.slice(6)).choices)t+=c.text}process.stdout.write(t)' "$TMP/body")
[ "$whole" = "$streamed" ] || pd_fail "stream text '$streamed' != '$whole'"
! grep -q '"usage"' "$TMP/body" || pd_fail "usage sent without include_usage"
ok

# Prefix cache: the same long prompt twice → cached_tokens > 0 the second time.
long=$(printf 'And God saw every thing that he had made, and, behold, it was very good. %.0s' 1 2 3 4 5 6)
req POST /v1/completions "{\"prompt\":\"$long\",\"max_tokens\":2}" >/dev/null
req POST /v1/completions "{\"prompt\":\"$long\",\"max_tokens\":2}" >/dev/null
cached=$(grep -o '"cached_tokens":[0-9]*' "$TMP/body" | cut -d: -f2)
[ "${cached:-0}" -ge 16 ] || pd_fail "repeated prompt: cached_tokens=$cached"
ok

# Stop strings: the text ends before the stop string, finish_reason "stop".
req POST /v1/completions '{"prompt":"In the beginning God created the heaven","max_tokens":64,"temperature":0,"ignore_eos":true}' >/dev/null
full=$(node -e 'process.stdout.write(JSON.parse(require("fs").readFileSync(process.argv[1])).choices[0].text)' "$TMP/body")
stop=$(node -e 'const t=process.argv[1];process.stdout.write(t.slice(6,10))' "$full")
req POST /v1/completions "{\"prompt\":\"In the beginning God created the heaven\",\"max_tokens\":64,\"temperature\":0,\"ignore_eos\":true,\"stop\":[$(node -e 'process.stdout.write(JSON.stringify(process.argv[1]))' "$stop")]}" >/dev/null
has '"finish_reason":"stop"' stop
got=$(node -e 'process.stdout.write(JSON.parse(require("fs").readFileSync(process.argv[1])).choices[0].text)' "$TMP/body")
want=$(node -e 'const t=process.argv[1],s=process.argv[2];process.stdout.write(t.slice(0,t.indexOf(s)))' "$full" "$stop")
[ "$got" = "$want" ] || pd_fail "stop string: got '$got' want '$want'"
ok

# n > 1 with a seed: n choices with indexes 0..n-1; batch prompts: one choice per prompt.
req POST /v1/completions '{"prompt":"And","max_tokens":4,"n":3,"seed":7}' >/dev/null
has '"index":2' n3; [ "$(grep -o '"index":' "$TMP/body" | wc -l)" = 3 ] || pd_fail "n=3"; ok
req POST /v1/completions '{"prompt":["And","But"],"max_tokens":3,"temperature":0}' >/dev/null
[ "$(grep -o '"index":' "$TMP/body" | wc -l)" = 2 ] || pd_fail "batch prompts"; ok
has '"completion_tokens":6' batch

# Logprobs in both shapes.
req POST /v1/completions '{"prompt":"And","max_tokens":3,"logprobs":2,"temperature":0}' >/dev/null
has '"logprobs":{"tokens":\[' lp; has '"token_logprobs":\[' lp; has '"text_offset":\[0,' lp
req POST /v1/chat/completions '{"messages":[{"role":"user","content":"And"}],"max_tokens":3,"logprobs":true,"top_logprobs":2}' >/dev/null
has '"logprobs":{"content":\[{"token":' chatlp; has '"bytes":\[' chatlp; has '"top_logprobs":\[{"token":' chatlp

# Router-facing endpoints: /internal/tokenize, /internal/state, return_token_ids.
req POST /internal/tokenize '{"prompt":"And God"}' >/dev/null; has '{"token_ids":\[4092,' tokenize
req POST /internal/tokenize '{"messages":[{"role":"user","content":"And"}]}' >/dev/null; has '{"token_ids":\[4092,4094,' tokenize_chat
[ "$(req GET '/internal/state?since=0')" = 200 ] || pd_fail "/internal/state"
has '"type":"state"' state; has '"kv_blocks_total":1024' state; has '"seq_next":' state
[ "$(req GET '/internal/state?since=abc')" = 400 ] || pd_fail "/internal/state?since=abc"
req POST /v1/completions '{"prompt":"And","max_tokens":5,"temperature":0,"stream":true,"return_token_ids":true}' >/dev/null
n_ids=$(node -e 'let n=0;for(const l of require("fs").readFileSync(process.argv[1],"utf8").split("\n\n")){if(!l.startsWith("data: {"))continue;for(const c of JSON.parse(l.slice(6)).choices)n+=c.token_ids.length}process.stdout.write(String(n))' "$TMP/body")
[ "$n_ids" = 5 ] || pd_fail "return_token_ids: $n_ids ids streamed, want 5"
req POST /v1/completions '{"prompt":"And","max_tokens":4,"return_token_ids":true}' >/dev/null
grep -q '"token_ids":\[[0-9]*,[0-9]*,[0-9]*,[0-9]*\]' "$TMP/body" || pd_fail "return_token_ids (non-stream): $(cat "$TMP/body")"
ok

# ---- 2. bad input ---------------------------------------------------------------------------
C=/v1/completions; H=/v1/chat/completions
bad 400 null $C '{"prompt":'
bad 400 null $C '[1,2,3]'
bad 404 model $C '{"model":"gpt-4","prompt":"x"}'
grep -q '"code":"model_not_found"' "$TMP/body" || pd_fail "model_not_found code"
bad 400 model $C '{"model":7,"prompt":"x"}'
bad 400 prompt $C '{}'
bad 400 prompt $C '{"prompt":5}'
bad 400 prompt $C '{"prompt":[]}'
bad 400 prompt $C '{"prompt":[1,"a"]}'
bad 400 prompt $C '{"prompt":[99999]}'
bad 400 messages $H '{}'
bad 400 messages $H '{"messages":[]}'
bad 400 messages $H '{"messages":[{"content":"x"}]}'
bad 400 messages $H '{"messages":[{"role":"user","content":7}]}'
bad 400 max_tokens $C '{"prompt":"x","max_tokens":0}'
bad 400 max_tokens $C '{"prompt":"x","max_tokens":-5}'
bad 400 max_tokens $C '{"prompt":"x","max_tokens":"10"}'
bad 400 max_completion_tokens $H '{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}'
bad 400 max_tokens $C '{"prompt":"x","max_tokens":100000}'
bad 400 prompt $C "{\"prompt\":[$(node -e 'process.stdout.write(Array(2100).fill(5).join(","))')]}"
bad 400 messages $H "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":2040}"
bad 400 temperature $C '{"prompt":"x","temperature":-1}'
bad 400 temperature $C '{"prompt":"x","temperature":"hot"}'
bad 400 top_p $C '{"prompt":"x","top_p":0}'
bad 400 top_k $C '{"prompt":"x","top_k":-7}'
bad 400 min_p $C '{"prompt":"x","min_p":1.5}'
bad 400 presence_penalty $C '{"prompt":"x","presence_penalty":9}'
bad 400 frequency_penalty $C '{"prompt":"x","frequency_penalty":-9}'
bad 400 repetition_penalty $C '{"prompt":"x","repetition_penalty":0}'
bad 400 seed $C '{"prompt":"x","seed":"abc"}'
bad 400 n $C '{"prompt":"x","n":0}'
bad 400 n $C '{"prompt":"x","n":17}'
bad 400 stop $C '{"prompt":"x","stop":7}'
bad 400 stop $C '{"prompt":"x","stop":[""]}'
bad 400 stop $C '{"prompt":"x","stop":["1","2","3","4","5","6","7","8","9","10","11","12","13","14","15","16","17"]}'
bad 400 logprobs $C '{"prompt":"x","logprobs":21}'
bad 400 logprobs $H '{"messages":[{"role":"user","content":"x"}],"logprobs":3}'
bad 400 top_logprobs $H '{"messages":[{"role":"user","content":"x"}],"top_logprobs":3}'
bad 400 stream $C '{"prompt":"x","stream":"yes"}'
bad 400 stream_options $C '{"prompt":"x","stream_options":{"include_usage":true}}'
bad 400 echo $C '{"prompt":"x","echo":true}'
bad 400 ignore_eos $C '{"prompt":"x","ignore_eos":"no"}'
bad 400 priority $C '{"prompt":"x","priority":"high"}'
# Unknown fields are a 400 naming them; fields that change nothing here are accepted (api.h policy).
bad 400 frobnicate $C '{"prompt":"x","max_tokens":1,"frobnicate":{"a":1}}'
[ "$(req POST $C '{"prompt":"x","max_tokens":1,"user":"me","metadata":{"k":"v"},"store":false,"service_tier":"auto"}')" = 200 ] || pd_fail "harmless fields"; ok
# Routing errors and the body limit.
code=$(req GET /v1/nope); [ "$code" = 404 ] || pd_fail "unknown route: $code"; has '"type":"invalid_request_error"' route404
code=$(req GET /v1/completions); [ "$code" = 405 ] || pd_fail "wrong method: $code"
grep -qi '^allow: POST' "$TMP/headers" || pd_fail "405 without Allow"; has '"error":{' route405
head -c 9437184 /dev/zero | tr '\0' 'a' | sed 's/^/{"prompt":"/; s/$/"}/' >"$TMP/big.json"
code=$(curl -s -o "$TMP/body" -w '%{http_code}' -H 'Content-Type: application/json' --data-binary @"$TMP/big.json" "$URL$C")
[ "$code" = 413 ] || pd_fail "9 MiB body: $code"; has '"error":{"message":"request body too large' body413
# Queue full → 503 with Retry-After (server E: one running sequence, one waiting slot).
$LOAD burst "$URL_E" 6 '{"prompt":"And","max_tokens":200,"ignore_eos":true}' >"$TMP/burst"
grep -q '^503 1 {"error":{"message":".*","type":"server_error"' "$TMP/burst" || pd_fail "no 503: $(cat "$TMP/burst")"
grep -q '^200 ' "$TMP/burst" || pd_fail "burst: nothing served"
ok
URL=$URL_E
[ "$(req GET /v1/models)" = 200 ] && has '"max_model_len":512' flags
bad 400 max_tokens $C '{"prompt":"x","max_tokens":512}'
curl -s "$URL_E/metrics" >"$TMP/metrics_e"
nb=$(pd_metric "$TMP/metrics_e" pdserve_kv_blocks_total)
[ "${nb:-0}" -gt 0 ] && [ "$nb" -lt 1024 ] || pd_fail "--kv-cache-memory 16M gave $nb blocks"
URL=$URL_A
echo "ok   endpoints and bad input ($n_checks checks)"

# ---- 3. greedy consistency ------------------------------------------------------------------
$LOAD greedy "$URL_A" "$TMP/g_alone.json" alone || pd_fail "greedy A"
$LOAD greedy "$URL_A" "$TMP/g_crowd.json" crowd || pd_fail "greedy A crowd"
$LOAD greedy "$URL_B" "$TMP/g_b.json" crowd || pd_fail "greedy B"
$LOAD greedy "$URL_C" "$TMP/g_c.json" alone || pd_fail "greedy C"
$LOAD greedy "$URL_D" "$TMP/g_d.json" crowd || pd_fail "greedy D"
for f in g_crowd g_b g_c g_d; do
  cmp -s "$TMP/g_alone.json" "$TMP/$f.json" || { diff "$TMP/g_alone.json" "$TMP/$f.json" >&2; pd_fail "greedy outputs differ: alone vs $f"; }
done
curl -s "$URL_D/metrics" >"$TMP/metrics_d"
pre=$(pd_metric "$TMP/metrics_d" pdserve_num_preemptions_total)
[ "${pre:-0}" -gt 0 ] || pd_fail "memory-pressure server D never preempted (pdserve_num_preemptions_total=$pre)"
echo "ok   greedy outputs identical: prefix cache on/off, budgets 16/64/2048, alone vs 32 concurrent, preemption ($pre preemptions)"

# ---- 4. soak --------------------------------------------------------------------------------
for s in B C D E; do pd_stop $s; done  # free the CPU for the soak
# Many connections on the one event-loop thread: 400 idle sockets + 16 open streams.
$LOAD idle "$URL" 400 || pd_fail "idle connections"
curl -s "$URL/metrics" >"$TMP/metrics0"
free0=$(pd_metric "$TMP/metrics0" pdserve_kv_blocks_free)
total=$(pd_metric "$TMP/metrics0" pdserve_kv_blocks_total)
$LOAD soak "$URL" 500 64 || pd_fail "soak"
# Aborts are asynchronous: poll until the engine has let go of every block.
idle() {
  curl -s "$URL/metrics" >"$TMP/metrics1" &&
  [ "$(pd_metric "$TMP/metrics1" pdserve_kv_blocks_used)" = 0 ] &&
  [ "$(pd_metric "$TMP/metrics1" pdserve_num_requests_running)" = 0 ] &&
  [ "$(pd_metric "$TMP/metrics1" pdserve_num_requests_waiting)" = 0 ] &&
  [ "$(pd_metric "$TMP/metrics1" pdserve_http_requests_in_flight)" = 0 ]
}
pd_wait_for 30 idle || pd_fail "after the soak the server did not go idle: $(grep -E '^pdserve_(kv|num)' "$TMP/metrics1")"
free1=$(pd_metric "$TMP/metrics1" pdserve_kv_blocks_free)
[ "$free1" = "$free0" ] && [ "$free1" = "$total" ] || pd_fail "KV pool: free $free1 after, $free0 before, $total total"
grep -q '^pdserve_request_success_total{finish_reason="abort"} [1-9]' "$TMP/metrics1" || pd_fail "no aborts counted"
grep -q '^pdserve_http_responses_total{status="200"} [1-9]' "$TMP/metrics1" || pd_fail "no 200s counted"
grep -q '^pdserve_time_to_first_token_seconds_count [1-9]' "$TMP/metrics1" || pd_fail "no TTFT samples"
grep -q '^pdserve_inter_token_latency_seconds_bucket{le="+Inf"} [1-9]' "$TMP/metrics1" || pd_fail "no ITL samples"
grep -q '^pdserve_e2e_request_latency_seconds_sum ' "$TMP/metrics1" || pd_fail "no e2e histogram"
grep -q '^pdserve_prefix_cache_hits_total [1-9]' "$TMP/metrics1" || pd_fail "no prefix cache hits"
grep -q '^pdserve_generation_tokens_total [1-9]' "$TMP/metrics1" || pd_fail "no generation tokens"
grep -q '^# TYPE pdserve_request_success_total counter' "$TMP/metrics1" || pd_fail "metric TYPE lines"
[ "$(req POST /v1/completions '{"prompt":"And","max_tokens":2}')" = 200 ] || pd_fail "server dead after soak"
echo "ok   soak: 500 requests / 64 clients, KV pool back to $free1/$total free"

# ---- 5. router registration (--router): register, serve through the router, deregister --------
printf 'tok-%s\n' "$$" >"$TMP/token"
"$PD_BIN" router --port 0 --auth-token-file "$TMP/token" >"$TMP/router.out" 2>"$TMP/router.err" &
echo $! >"$TMP/router.pid"
pd_wait_for 30 grep -q 'http://' "$TMP/router.out" || pd_fail "router did not start: $(cat "$TMP/router.err")"
RURL=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/router.out" | head -1)
pd_start R --num-kv-blocks 256 --router "$RURL" --router-token-file "$TMP/token"
pd_wait_for 30 grep -q 'registered with router' "$TMP/R.err" || pd_fail "worker never registered: $(cat "$TMP/R.err")"
URL=$RURL
pd_wait_for 30 sh -c "[ \$(curl -s -o /dev/null -w '%{http_code}' -d '{\"prompt\":\"And\",\"max_tokens\":3}' $RURL/v1/completions) = 200 ]" ||
  pd_fail "no completion through the router"
pd_stop R
pd_wait_for 10 grep -q 'removed' "$TMP/router.err" || pd_fail "worker did not deregister: $(cat "$TMP/router.err")"
echo "ok   --router: registered, served through the router, deregistered at exit"
URL=$URL_A

# ---- 6. clean shutdown ----------------------------------------------------------------------
pd_stop A
echo "ok   SIGTERM: all servers exited with status 0"
echo "test_api.sh: PASS"
