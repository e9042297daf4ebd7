#!/bin/sh
# test_bench_report.sh — the bench HTML report says why requests failed and fits a laptop screen:
#   1. two runs with known failures: the fake server failing every 3rd request (HTTP 500,
#      server_error) and a real router with capacity for 2 requests per worker under 12 concurrent
#      streams (HTTP 503, code "capacity"); `bench merge` makes one report
#   2. its "Failures by reason" table lists both reasons with the right counts
#   3. rendered in headless Chromium at 1366x768 (a harness page measures the report in an iframe of
#      that size): no table is wider than the viewport (nothing cut off); a screenshot
#      (PD_REPORT_SCREENSHOT=path keeps it)
# Needs python3 and chromium.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
for t in python3 chromium curl; do command -v $t >/dev/null || pd_fail "$t is required"; done

# ---- 1. two runs with failures ----------------------------------------------------------------------
python3 "$here/../helpers/fake_openai.py" --port 0 --ttft-ms 5 --itl-ms 2 --fail-every 3 >"$TMP/fake.log" 2>&1 &
echo $! >"$TMP/fake.pid"
pd_wait_for 10 grep -qs '^port ' "$TMP/fake.log" || pd_fail "fake server did not start"
furl="http://127.0.0.1:$(sed -n 's/^port //p' "$TMP/fake.log")"
"$PD_BIN" bench --url "$furl" --num-prompts 12 --request-rate inf --input-len 8 --output-len 4 --label fake \
  --output-json "$TMP/fake.json" --quiet --timeout-s 30 >"$TMP/fake.out" 2>&1 || pd_fail "bench (fake): $(cat "$TMP/fake.out")"

pd_start A
echo '{"capacity_per_worker":2}' >"$TMP/qos.json"
"$PD_BIN" router --host 127.0.0.1 --port 0 --worker "$URL_A" --qos-config "$TMP/qos.json" >"$TMP/R.out" 2>"$TMP/R.err" &
echo $! >"$TMP/R.pid"
pd_wait_for 20 grep -q 'http://' "$TMP/R.out" || pd_fail "router did not start"
R=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/R.out" | head -1)
pd_wait_for 10 curl -sf "$R/health" || pd_fail "router /health"
"$PD_BIN" bench --url "$R" --num-prompts 24 --request-rate inf --max-concurrency 12 --input-len 16 --output-len 24 \
  --label "router, capacity 2" --output-json "$TMP/router.json" --quiet --timeout-s 60 \
  >"$TMP/router.out" 2>&1 || pd_fail "bench (router): $(cat "$TMP/router.out")"
"$PD_BIN" bench merge --output-html "$TMP/report.html" --output-svg-dir "$TMP/svg" "$TMP/fake.json" "$TMP/router.json" \
  >"$TMP/merge.out" 2>&1 || pd_fail "bench merge: $(cat "$TMP/merge.out")"

# ---- 2. failures by reason ------------------------------------------------------------------------
python3 - "$TMP/report.html" "$TMP/fake.json" "$TMP/router.json" <<'EOF' || pd_fail "failures table"
import json, re, sys
html = open(sys.argv[1]).read()
m = re.search(r'<table id="failures">(.*?)</table>', html, re.S)
assert m, "no failures table"
rows = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)]
rows = [r for r in rows if r]
got = {(r[0], r[2]): int(r[3]) for r in rows}
def failed(path):
    return sum(1 for r in json.load(open(path))["runs"][0]["requests"] if not r["ok"])
want_fake, want_router = failed(sys.argv[2]), failed(sys.argv[3])
assert want_fake == 4 and want_router >= 1, (want_fake, want_router)
assert got.get(("fake", "HTTP 500 server_error")) == want_fake, got
assert got.get(("router, capacity 2", "HTTP 503 capacity")) == want_router, got
print("2. failures by reason:", got)
EOF

# ---- 3. fits 1366x768 -------------------------------------------------------------------------------
cat >"$TMP/harness.html" <<'EOF'
<!DOCTYPE html><html><body style="margin:0">
<iframe id="f" src="report.html" style="border:0;width:1366px;height:768px"></iframe>
<pre id="out">pending</pre>
<script>
document.getElementById('f').onload = () => {
  const d = document.getElementById('f').contentDocument, vw = d.documentElement.clientWidth;
  const res = {viewport: vw, tables: []};
  d.querySelectorAll('table').forEach(t => {
    const r = t.getBoundingClientRect();
    res.tables.push({id: t.id, right: Math.round(r.right), scroll: t.parentElement.scrollWidth - t.parentElement.clientWidth});
  });
  res.page_scroll_x = d.documentElement.scrollWidth - vw;
  document.getElementById('out').textContent = JSON.stringify(res);
};
</script></body></html>
EOF
chrome() { chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$TMP/chrome" --allow-file-access-from-files \
  --virtual-time-budget=3000 "$@" 2>/dev/null; }
chrome --window-size=1400,900 --dump-dom "file://$TMP/harness.html" >"$TMP/harness.dom" || pd_fail "chromium --dump-dom"
python3 - "$TMP/harness.dom" <<'EOF' || pd_fail "the report does not fit 1366x768: $(grep -o '<pre id="out">[^<]*' "$TMP/harness.dom")"
import html, json, re, sys
m = re.search(r'<pre id="out">([^<]*)</pre>', open(sys.argv[1]).read())
res = json.loads(html.unescape(m.group(1)))
vw = res["viewport"]
assert vw >= 1300, res
assert {t["id"] for t in res["tables"]} >= {"summary", "failures"}, res
for t in res["tables"]:
    assert t["right"] <= vw and t["scroll"] <= 0, t
assert res["page_scroll_x"] <= 0, res
print("3. report at 1366x768:", res)
EOF
chrome --window-size=1366,768 --screenshot="$TMP/report.png" "file://$TMP/report.html" >/dev/null || pd_fail "screenshot"
[ -s "$TMP/report.png" ] || pd_fail "empty screenshot"
[ -n "${PD_REPORT_SCREENSHOT:-}" ] && cp "$TMP/report.png" "$PD_REPORT_SCREENSHOT"
echo "test_bench_report: all checks passed"
