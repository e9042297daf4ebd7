#!/bin/sh
# test_structured.sh — structured outputs, tool calls and logit_bias against the bundled model:
# the real clients (tests/integration/js/structured.mjs: openai, Vercel AI SDK, LangChain JS), then
# the HTTP contract with curl: refused fields and schemas are 400s naming them, json_object and
# GBNF outputs follow their grammar, a required tool choice works through the Hermes fallback of a
# template without tool support, and n > 1 constrained choices each get their own matcher.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
command -v node >/dev/null || pd_fail "node is required"
command -v curl >/dev/null || pd_fail "curl is required"
for m in openai ai @ai-sdk/openai-compatible zod @langchain/openai @langchain/core; do
  [ -d "$here/js/node_modules/$m" ] && continue
  command -v npm >/dev/null || pd_fail "npm is required to install the js clients"
  (cd "$here/js" && npm ci --no-audit --no-fund --silent) || pd_fail "npm ci failed"
  break
done
pd_start A --num-kv-blocks 1024 --served-model-name kjv-llama-6m
node "$here/js/structured.mjs" "$URL" kjv-llama-6m || pd_fail "structured output / tool clients"

post() {
  curl -s -o "$TMP/body" -w '%{http_code}' -H 'Content-Type: application/json' --data-binary "$2" "$URL$1"
}
want() {  # want STATUS PARAM BODY: a 400 (or other) naming PARAM
  code=$(post /v1/chat/completions "$3")
  [ "$code" = "$1" ] || pd_fail "$3: status $code, want $1: $(cat "$TMP/body")"
  grep -q "\"param\":\"$2\"" "$TMP/body" || pd_fail "$3: want param $2 in $(cat "$TMP/body")"
}
M='"messages":[{"role":"user","content":"In the beginning"}]'
want 400 respose_format "{$M,\"respose_format\":{\"type\":\"json_object\"}}"
want 400 audio "{$M,\"audio\":{\"voice\":\"alloy\"}}"
want 400 response_format "{$M,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"type\":\"string\",\"pattern\":\"^a\"}}}}"
grep -q "pattern" "$TMP/body" || pd_fail "the refused schema keyword is not named: $(cat "$TMP/body")"
want 400 grammar "{$M,\"grammar\":\"root ::= undefined-rule\"}"
want 400 logit_bias "{$M,\"logit_bias\":{\"999999\":5}}"
# A JSON body over the limit: a JSON 413, not libevent's HTML.
code=$(head -c 9000000 /dev/zero | tr '\0' ' ' | curl -s -o "$TMP/body" -w '%{http_code}' -H 'Content-Type: application/json' --data-binary @- "$URL/v1/chat/completions")
[ "$code" = 413 ] || pd_fail "9 MB body: status $code"
grep -q '^{"error":' "$TMP/body" || pd_fail "413 is not JSON: $(head -c 200 "$TMP/body")"

# GBNF: the text is exactly one of the grammar's sentences.
code=$(post /v1/completions '{"prompt":"And God said","max_tokens":40,"temperature":1,"seed":3,"n":3,"grammar":"root ::= (\"yea\" | \"nay\") (\", \" (\"yea\" | \"nay\")){0,3} \".\""}')
[ "$code" = 200 ] || pd_fail "grammar: $code $(cat "$TMP/body")"
node -e '
const r = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
if (r.choices.length !== 3) throw new Error("n=3 gave " + r.choices.length);
for (const c of r.choices) {
  if (c.finish_reason !== "stop" || !/^(yea|nay)(, (yea|nay)){0,3}\.$/.test(c.text)) throw new Error("off-grammar: " + JSON.stringify(c));
}' "$TMP/body" || pd_fail "grammar outputs"
# A failover continuation (the router's re-issue): the prompt ends with output already generated
# (continuation_tokens), and the grammar resumes after it instead of starting over; output that
# does not follow the grammar is a 400.
node --input-type=module -e '
const base = process.argv[1];
const post = async (path, body) => { const r = await fetch(base + path, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) }); return [r.status, await r.json()]; };
const ids = async (text) => (await post("/internal/tokenize", { prompt: text }))[1].token_ids;
const head = await ids("And God said"), bos = head[0];
const tail = async (text) => { const t = await ids(text); return t[0] === bos ? t.slice(1) : t; };
const grammar = "root ::= \"yea\" (\", \" (\"yea\" | \"nay\")){1,3} \".\"";
for (const seed of [1, 2, 3]) {
  const yea = await tail("yea");
  const [st, r] = await post("/v1/completions", { prompt: [...head, ...yea], continuation_tokens: yea.length, grammar, max_tokens: 30, seed, temperature: 1 });
  if (st !== 200) throw new Error("continuation: " + st + " " + JSON.stringify(r));
  const t = r.choices[0].text;
  if (r.choices[0].finish_reason !== "stop" || !/^(, (yea|nay)){1,3}\.$/.test(t)) throw new Error("continuation restarted the grammar: " + JSON.stringify(t));
}
const nay = await tail("nay");
const [st, r] = await post("/v1/completions", { prompt: [...head, ...nay], continuation_tokens: nay.length, grammar, max_tokens: 5 });
if (st !== 400 || r.error.param !== "continuation_tokens") throw new Error("off-grammar continuation: " + st + " " + JSON.stringify(r));
' "$URL" || pd_fail "continuation_tokens"
# json_object: an object whenever the model finished (a cut reply is a prefix of one).
code=$(post /v1/chat/completions "{$M,\"max_tokens\":300,\"seed\":5,\"n\":4,\"response_format\":{\"type\":\"json_object\"}}")
[ "$code" = 200 ] || pd_fail "json_object: $code"
node -e '
const r = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
for (const c of r.choices) {
  const t = c.message.content;
  if (!t.startsWith("{")) throw new Error("json_object reply does not open an object: " + t);
  if (c.finish_reason === "stop" && typeof JSON.parse(t) !== "object") throw new Error("not an object: " + t);
}' "$TMP/body" || pd_fail "json_object outputs"
pd_stop A
echo "test_structured.sh: PASS"
