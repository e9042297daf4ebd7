#!/bin/sh
# test_bench.sh — `pdserve bench` end to end, in two parts:
#   1. the harness against tests/helpers/fake_openai.py, whose timing and failures are known:
#      failure accounting (--fail-every), token counts from usage, ITL/TTFT against the injected
#      delays, goodput, the chat endpoint, a rate sweep;
#   2. the real server: `pdserve serve` with the bundled kjv-llama-6m on a free port, 20 prompts at
#      10 req/s (input 32, output 16); the JSON is validated (fields, counts, ordered percentiles,
#      TPOT consistent with TTFT/E2E), the HTML must be self-contained and hold the SVG charts, and
#      `bench merge` must combine both parts into one report.
# Bounded: every wait has a deadline and the benchmark runs under --timeout-s; the whole script
# stays under 60 s on a 2-core machine.
set -u
repo=${PD_REPO_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
bin=${PD_BIN:-$repo/build/pdserve}
tmp=$(mktemp -d /tmp/pd_test_bench.XXXXXX)
pids=""
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null; done
  for p in $pids; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*"; for f in "$tmp"/*.log "$tmp"/*.out; do [ -f "$f" ] && { echo "--- $f"; tail -20 "$f"; }; done; exit 1; }

# wait_for "shell condition" seconds: polls every 0.1 s until the condition holds.
wait_for() {
  n=$(($2 * 10))
  while [ $n -gt 0 ]; do
    if eval "$1"; then return 0; fi
    sleep 0.1
    n=$((n - 1))
  done
  return 1
}

command -v python3 >/dev/null || fail "python3 is required (installed by make deps)"
command -v curl >/dev/null || fail "curl is required (installed by make deps)"
[ -x "$bin" ] || fail "no binary at $bin"
start=$(date +%s)

# ---- 1. the harness against the fake server --------------------------------------------------------
python3 "$repo/tests/helpers/fake_openai.py" --port 0 --ttft-ms 30 --itl-ms 8 --fail-every 5 > "$tmp/fake.log" 2>&1 &
pids="$pids $!"
wait_for "grep -qs '^port ' '$tmp/fake.log'" 10 || fail "fake server did not start"
fport=$(sed -n 's/^port //p' "$tmp/fake.log")
furl="http://127.0.0.1:$fport"

"$bin" bench --url "$furl" --num-prompts 10 --request-rate inf --input-len 8 --output-len 6 \
  --goodput ttft:25 tpot:1000 --label fake --output-json "$tmp/fake.json" --quiet --timeout-s 20 \
  > "$tmp/fake.out" 2>&1 || fail "bench against the fake server"
grep -q "Successful requests: *8" "$tmp/fake.out" || fail "summary: expected 8 successful requests"
grep -q "Failed requests: *2" "$tmp/fake.out" || fail "summary: expected 2 failed requests"

python3 - "$tmp/fake.json" <<'EOF' || fail "fake JSON checks"
import json, sys
d = json.load(open(sys.argv[1]))
run = d["runs"][0]; m = run["metrics"]; reqs = run["requests"]
assert run["model"] == "fake-model", run["model"]          # discovered through /v1/models
assert m["completed"] == 8 and m["failed"] == 2, m
assert len(reqs) == 10
bad = [r for r in reqs if not r["ok"]]
assert all(r["http_status"] == 500 and "injected failure" in r["error"] for r in bad), bad
for r in reqs:
    if not r["ok"]:
        continue
    assert r["output_tokens"] == 6 and r["chunks"] == 6 and r["prompt_tokens"] == 8, r
    assert len(r["itl_ms"]) == 5, r
    assert r["ttft_ms"] >= 29, r                               # the fake waits 30 ms
    # ... then sleeps 8 ms before each later token, so the whole answer takes >= 30 + 5*8 ms. (Single
    # gaps are not checked: a late write on a loaded machine makes the next gap short.)
    assert r["e2e_ms"] >= 69, r
    assert abs(r["tpot_ms"] - (r["e2e_ms"] - r["ttft_ms"]) / 5) < 1e-3, r
assert m["total_output_tokens"] == 48 and m["total_input_tokens"] == 64, m
# TTFT SLO of 25 ms cannot be met (30 ms injected): goodput is 0, not missing.
assert m["good_requests"] == 0 and m["goodput"] == 0, m
assert d["config"]["goodput"]["ttft_ms"] == 25
EOF

"$bin" bench --url "$furl" --endpoint /v1/chat/completions --num-prompts 3 --input-len 5 --output-len 4 \
  --output-json "$tmp/chat.json" --quiet --timeout-s 20 > "$tmp/chat.out" 2>&1 || fail "chat bench"
python3 -c "
import json,sys; m=json.load(open('$tmp/chat.json'))['runs'][0]['metrics']
assert m['total_output_tokens'] == 4 * m['completed'] and m['completed'] + m['failed'] == 3, m" \
  || fail "chat JSON checks"

"$bin" bench --url "$furl" --model fake-model --num-prompts 8 --sweep-rates 50,100 --input-len 4 --output-len 3 \
  --goodput ttft:500 --label fake-sweep --output-json "$tmp/sweep.json" --quiet --timeout-s 20 \
  > "$tmp/sweep.out" 2>&1 || fail "sweep bench"
python3 -c "
import json; d=json.load(open('$tmp/sweep.json'))
assert [r['request_rate'] for r in d['runs']] == [50, 100], d['runs']
assert all(r['metrics']['completed'] + r['metrics']['failed'] == 8 for r in d['runs'])" || fail "sweep JSON"

# Authorization and warmup: a fake that wants a key; warmup requests reach it but are not recorded.
python3 "$repo/tests/helpers/fake_openai.py" --port 0 --ttft-ms 1 --itl-ms 1 --api-key s3cret > "$tmp/fake2.log" 2>&1 &
pids="$pids $!"
wait_for "grep -qs '^port ' '$tmp/fake2.log'" 10 || fail "second fake server did not start"
furl2="http://127.0.0.1:$(sed -n 's/^port //p' "$tmp/fake2.log")"
OPENAI_API_KEY= "$bin" bench --url "$furl2" --num-prompts 2 --input-len 4 --output-len 2 --quiet \
  > "$tmp/noauth.out" 2>&1 && fail "bench without the key should fail (401 on /v1/models)"
grep -q "HTTP 401" "$tmp/noauth.out" || fail "no 401 reported"
"$bin" bench --url "$furl2" --api-key s3cret --num-warmups 3 --num-prompts 4 --input-len 4 --output-len 2 \
  --output-json "$tmp/auth.json" --quiet > "$tmp/auth.out" 2>&1 || fail "bench with --api-key"
python3 - "$tmp/auth.json" "$furl2" <<'EOF' || fail "auth/warmup checks"
import json, sys, urllib.request
m = json.load(open(sys.argv[1]))["runs"][0]["metrics"]
assert m["completed"] == 4 and m["failed"] == 0, m
served = json.load(urllib.request.urlopen(sys.argv[2] + "/stats"))["completions"]
assert served == 7, served  # 3 warmups + 4 measured
EOF

# ---- 2. the real server ----------------------------------------------------------------------------
model="$repo/models/kjv-llama-6m"
[ -d "$model" ] || fail "no model at $model"
# One OpenMP thread that sleeps when idle: a 6M-parameter model gains nothing from more, and spinning
# threads starve the benchmark client on a 2-core machine.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} \
  "$bin" serve --model "$model" --port 0 > "$tmp/serve.log" 2>&1 &
pids="$pids $!"
wait_for "grep -qs 'on http://' '$tmp/serve.log'" 40 || fail "pdserve serve did not start"
url=$(sed -n 's|.* on \(http://[0-9.:]*\).*|\1|p' "$tmp/serve.log" | head -1)
[ -n "$url" ] || fail "cannot find the server URL in its log"

"$bin" bench --url "$url" --num-prompts 20 --request-rate 10 --input-len 32 --output-len 16 \
  --goodput ttft:10000 tpot:5000 --label pdserve --output-json "$tmp/real.json" \
  --output-html "$tmp/real.html" --output-svg-dir "$tmp/svg" --timeout-s 40 --quiet \
  > "$tmp/real.out" 2>&1 || fail "bench against pdserve"
cat "$tmp/real.out"

python3 - "$tmp/real.json" <<'EOF' || fail "real JSON checks"
import json, math, sys
d = json.load(open(sys.argv[1]))
assert d["pdserve_bench_version"] == 1 and d["label"] == "pdserve"
assert d["config"]["dataset"]["name"] == "random" and d["config"]["dataset"]["input_len"] == 32
run = d["runs"][0]; m = run["metrics"]; reqs = run["requests"]
assert run["request_rate"] == 10 and run["model"] == "kjv-llama-6m", run["model"]
for k in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
          "request_throughput", "output_throughput", "total_token_throughput", "good_requests", "goodput"):
    assert k in m, k
assert m["completed"] == 20 and m["failed"] == 0, [r["error"] for r in reqs if not r["ok"]]
assert len(reqs) == 20 and sorted(r["idx"] for r in reqs) == list(range(20))
assert m["total_input_tokens"] == 640 and m["total_output_tokens"] == 320, m
for r in reqs:
    assert r["ok"] and r["http_status"] == 200 and r["error"] is None, r
    assert r["prompt_tokens"] == 32 and r["output_tokens"] == 16, r      # exact lengths (usage)
    assert len(r["itl_ms"]) == r["chunks"] - 1 and r["chunks"] >= 1, r
    assert 0 < r["ttft_ms"] <= r["e2e_ms"], r
    assert abs(r["tpot_ms"] - (r["e2e_ms"] - r["ttft_ms"]) / 15) < 1e-3, r
# Poisson arrivals at 10 req/s: 20 requests spread over about 2 s, in order.
starts = [r["start_s"] for r in reqs]
assert starts == sorted(starts) and 0.5 < starts[-1] < 10, starts
for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
    x = m[name]
    for k in ("n", "mean", "std", "min", "max", "median", "p90", "p99", "p99_9"):
        assert k in x and x[k] is not None, (name, k)
    assert x["min"] <= x["median"] <= x["p90"] <= x["p99"] <= x["p99_9"] <= x["max"], (name, x)
assert m["ttft_ms"]["n"] == 20 and m["itl_ms"]["n"] == sum(len(r["itl_ms"]) for r in reqs)
assert abs(m["request_throughput"] - 20 / m["duration_s"]) < 1e-6
assert abs(m["output_throughput"] - 320 / m["duration_s"]) < 1e-6
assert m["good_requests"] <= 20 and abs(m["goodput"] - m["good_requests"] / m["duration_s"]) < 1e-6
EOF

html="$tmp/real.html"
[ -s "$html" ] || fail "no HTML report"
grep -q "<svg" "$html" || fail "HTML has no <svg"
grep -Eiq "(src|href)=[\"']?https?://" "$html" && fail "HTML references external assets"
grep -Eiq "<script[^>]*src|<link[^>]*stylesheet" "$html" && fail "HTML loads scripts or stylesheets"
for c in ttft_cdf tpot_cdf itl_cdf e2e_cdf; do
  [ -s "$tmp/svg/$c.svg" ] || fail "missing $c.svg"
  grep -q "id=\"$c\"" "$html" || fail "HTML lacks the $c chart"
done

"$bin" bench merge --output-html "$tmp/merged.html" --output-svg-dir "$tmp/msvg" "$tmp/sweep.json" "$tmp/real.json" \
  > "$tmp/merge.out" 2>&1 || fail "bench merge"
grep -q "p99_ttft_vs_rate" "$tmp/merged.html" || fail "merged report lacks the sweep charts"
grep -q "fake-sweep" "$tmp/merged.html" && grep -q "kjv-llama-6m" "$tmp/merged.html" || fail "merged report lacks a configuration"
[ -s "$tmp/msvg/goodput_vs_rate.svg" ] || fail "merge did not write goodput_vs_rate.svg"
"$bin" bench merge --output-html "$tmp/x.html" "$tmp/fake.log" > /dev/null 2>&1 && fail "merge accepted a non-JSON file"

# --return-token-ids: every token is timed from its own chunk, so chunks == output tokens exactly.
"$bin" bench --url "$url" --num-prompts 6 --input-len 16 --output-len 12 --return-token-ids --quiet \
  --output-json "$tmp/ids.json" > /dev/null 2>&1 || fail "bench --return-token-ids"
python3 - "$tmp/ids.json" <<'PY' || fail "return-token-ids checks"
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
assert r["metrics"]["completed"] == 6, r["metrics"]
for q in r["requests"]:
    assert q["chunks"] == q["output_tokens"] == 12, q
PY

echo "test_bench: ok ($(( $(date +%s) - start )) s)"
