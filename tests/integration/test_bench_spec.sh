#!/bin/sh
# test_bench_spec.sh — `pdserve bench-spec` end to end on the CPU (the tool docs/benchmarks.md's
# GPU speculation figures come from):
#   1. the kjv pair (kjv-llama-1m drafting for kjv-llama-6m) on the golden file's
#      speculative_acceptance prompts, batches 1 and 3, modes off, adaptive, fixed, off: every line
#      reported, the fixed run drafted and accepted tokens, and every speculative run's greedy
#      output is byte-identical to speculation off ("same as off N/N": fp32 on the CPU is exact)
#      (and the fixed run's implied per-token acceptance gives its tokens per verify step); --serial:
#      batch 1 over several prompts in turn, every output compared, tokens summed; --serial 0 refused
#   2. ngram on a repeated prompt: drafted, accepted, identical; the JSON report has every run and
#      the per-position acceptance with its counts (consistent with accepted and the verify steps);
#      the interleaved protocol (METHOD:mode, two plain engines, 2 rounds): runs, median within
#      its range, the plain engines' pooled band, the summary; "paused" (a speculative engine timed
#      with speculation paused): plain runs, the active / paused ratio
#   3. bad input is refused with a message naming it
#   4. the controlled-acceptance fixture (dummy weights): a target whose layers 1.. write into the
#      residual stream scaled by 0, drafted by its own first layer (same seed), accepts every draft
#      and matches plain decoding; unscaled, the same pair disagrees; its flags are refused outside
#      --load-format dummy and outside the config's shape
#   5. the copy workload (--copy-chain P on a Markov target): acceptance 1 at P = 1, ~P below
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
pd_need python3
MD=$(dirname "$MODEL")
G="$MD/golden/kjv-llama-6m.json"
[ -e "$G" ] || G="${PD_MODELS_DIR:-$repo/../shared/models}/golden/kjv-llama-6m.json"
[ -e "$G" ] || pd_fail "golden/kjv-llama-6m.json not found"
GD=$(dirname "$G")
DRAFT="$GD/../kjv-llama-1m"
[ -e "$DRAFT/config.json" ] || DRAFT="${PD_MODELS_DIR:-$repo/../shared/models}/kjv-llama-1m"
[ -e "$DRAFT/config.json" ] || pd_fail "model kjv-llama-1m not found"

# ---- 1. the kjv pair ---------------------------------------------------------------------------------
# (PD_SPEC_DRAIN=1: the draining-batch model, off by default, runs here too: a closed batch drains.)
PD_SPEC_DRAIN=1 timeout 300 "$PD_BIN" bench-spec --model "$MODEL" --device cpu --speculative-method draft --speculative-model "$DRAFT" \
  --golden "$G" --golden-key speculative_acceptance --batches 1,3 --max-tokens 24 --modes off,adaptive,fixed,off \
  --json "$TMP/draft.json" >"$TMP/draft.out" 2>"$TMP/draft.err" || pd_fail "bench-spec draft: $(tail -5 "$TMP/draft.err")"
n=$(grep -c ' batch=' "$TMP/draft.out")
[ "$(grep ' batch=' "$TMP/draft.out" | grep -c 'same as')" -eq 6 ] || pd_fail "bench-spec draft: no comparison with off"
[ "$n" -eq 8 ] || pd_fail "bench-spec draft: $n result lines, want 8: $(cat "$TMP/draft.out")"
grep ' batch=' "$TMP/draft.out" | grep 'same as' | while read -r line; do
  echo "$line" | grep -Eq 'same as off ([0-9]+)/\1$' || { echo "FAIL: output differs from speculation off: $line" >&2; exit 1; }
done || exit 1
fixed1=$(grep ' fixed ' "$TMP/draft.out" | grep 'batch=1 ')
echo "$fixed1" | grep -Eq 'drafted [1-9]' || pd_fail "fixed k drafted nothing: $fixed1"
echo "$fixed1" | grep -Eq 'acceptance 0\.[0-9]*[1-9]' || pd_fail "fixed k accepted nothing: $fixed1"

fixed1a=$(echo "$fixed1" | sed -E 's/.*tokens\/verify ([0-9.]+).*implied a ([0-9.]+).*/\1 \2/')
python3 - $fixed1a <<'EOF' || pd_fail "implied a does not give the tokens per verify step (k = 4): $fixed1"
import sys
e, a = float(sys.argv[1]), float(sys.argv[2])
assert 0 < a < 1 and abs(sum(a ** j for j in range(5)) - e) < 0.006, (e, a)
EOF

# ---- 1b. --serial: batch 1 over 3 prompts in turn, every output compared --------------------------------
timeout 300 "$PD_BIN" bench-spec --model "$MODEL" --device cpu --speculative-method draft --speculative-model "$DRAFT" \
  --golden "$G" --golden-key speculative_acceptance --batches 1 --serial 3 --reps 1 --max-tokens 16 --modes off,fixed \
  --json "$TMP/serial.json" >"$TMP/serial.out" 2>"$TMP/serial.err" || pd_fail "bench-spec --serial: $(tail -5 "$TMP/serial.err")"
grep ' fixed ' "$TMP/serial.out" | grep -q 'same as off 3/3' || pd_fail "bench-spec --serial 3: $(cat "$TMP/serial.out")"
python3 - "$TMP/serial.json" <<'EOF' || pd_fail "bench-spec --serial: tokens of 3 requests"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    assert r["tokens"] == 3 * 15, r  # 16 tokens each, the first one (prefill) not counted
EOF
"$PD_BIN" bench-spec --model "$MODEL" --golden "$G" --serial 0 >/dev/null 2>"$TMP/bad.err" && pd_fail "--serial 0 accepted"
grep -q "serial" "$TMP/bad.err" || pd_fail "--serial 0: no message naming it"

# ---- 2. ngram on a repetitive prompt, the JSON report ------------------------------------------------
timeout 300 "$PD_BIN" bench-spec --model "$MODEL" --device cpu --speculative-method ngram --golden "$G" --repeat 3 \
  --batches 2 --max-tokens 24 --modes off,fixed --json "$TMP/ngram.json" >"$TMP/ngram.out" 2>"$TMP/ngram.err" ||
  pd_fail "bench-spec ngram: $(tail -5 "$TMP/ngram.err")"
python3 - "$TMP/draft.json" "$TMP/ngram.json" <<'EOF' || pd_fail "bench-spec JSON reports"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["method"] == "draft" and len(d["results"]) == 8, d
for r in d["results"]:
    assert r["tok_s"] > 0 and r["tokens"] > 0, r
    if r["mode"] != "off" or r["same_as_off"] >= 0:
        assert r["same_as_off"] == r["batch"] or r["same_as_off"] == -1, r
g = json.load(open(sys.argv[2]))
f = [r for r in g["results"] if r["mode"] == "fixed"][0]
assert f["drafted"] > 0 and f["accepted"] > 0 and f["same_as_off"] == 2, f
assert f["tokens_per_verify"] > 1.0, f
# per-position acceptance: reached[0] = the verify sequence-steps, the accepted drafts sum over the
# positions, reached[j + 1] <= accepted[j], each rate accepted / reached; the share of decode steps
# that drafted in (0, 1]
for r in d["results"] + g["results"]:
    if r["mode"] == "off":
        continue
    re, ac, pp = r["pos_reached_total"], r["pos_accepted_total"], r["per_position_acceptance"]
    assert re[0] == r["verify_steps_total"] and sum(ac) == r["accepted_total"], r
    assert all(0 <= ac[j] <= re[j] for j in range(len(re))), r
    assert all(re[j + 1] <= ac[j] for j in range(len(re) - 1)), r
    assert len(pp) == sum(1 for x in re if x > 0) and all(abs(pp[j] - ac[j] / re[j]) < 1e-9 for j in range(len(pp))), r
    if r["drafted"] > 0:
        assert 0 < r["drafting_step_share"] <= 1, r
assert f["pos_reached_total"][0] > 0 and f["per_position_acceptance"][0] > 0, f
EOF
grep -q 'drafting steps 0\.[0-9]*  per-position 0\.[0-9]' "$TMP/ngram.out" || pd_fail "no per-position acceptance printed: $(cat "$TMP/ngram.out")"

# ---- 2b. the interleaved protocol: METHOD:mode, two plain engines, rounds, median, band ------------
timeout 300 "$PD_BIN" bench-spec --model "$MODEL" --device cpu --golden "$G" --repeat 2 --batches 2 --max-tokens 12 \
  --modes off,ngram:fixed,off --reps 2 --json "$TMP/il.json" >"$TMP/il.out" 2>"$TMP/il.err" ||
  pd_fail "bench-spec interleaved: $(tail -5 "$TMP/il.err")"
grep -q '^summary B=2: plain .*band \[.*ngram fixed' "$TMP/il.out" || pd_fail "no summary line: $(cat "$TMP/il.out")"
python3 - "$TMP/il.json" <<'EOF2' || pd_fail "bench-spec interleaved JSON"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["interleaved"] and d["reps"] == 2, d
assert [r["mode"] for r in d["results"]] == ["off", "fixed", "off"], d["results"]
for r in d["results"]:
    assert len(r["runs"]) == 2 and r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"], r
f = d["results"][1]
assert f["method"] == "ngram" and f["drafted"] > 0 and f["same_as_off"] == 2, f
s = d["summary"][0]
assert s["batch"] == 2 and s["plain_runs"] == 4 and s["plain_engines"] == 2, s
assert s["plain_band_lo"] <= 1.0 <= s["plain_band_hi"], s
sp = s["speculative"][0]
assert sp["method"] == "ngram" and sp["mode"] == "fixed" and abs(sp["ratio"] - f["speedup"]) < 1e-9, sp
assert d["workload"][0]["batch"] == 2, d["workload"]
EOF2

# ---- 2c. "paused": a speculative engine timed again with speculation paused (the same engine's plain
# steps): its runs are plain (nothing drafted, same output as off), and the summary gives the
# active / paused ratio per round with its median
timeout 300 "$PD_BIN" bench-spec --model "$MODEL" --device cpu --golden "$G" --repeat 2 --batches 2 --max-tokens 12 \
  --modes off,ngram:fixed,paused --reps 2 --json "$TMP/pz.json" >"$TMP/pz.out" 2>"$TMP/pz.err" ||
  pd_fail "bench-spec paused: $(tail -5 "$TMP/pz.err")"
grep -q '^summary B=2: .*ngram fixed / paused, engine 1: [0-9.]* [0-9.]* (median ' "$TMP/pz.out" || pd_fail "no paused ratio: $(cat "$TMP/pz.out")"
python3 - "$TMP/pz.json" <<'EOF2' || pd_fail "bench-spec paused JSON"
import json, sys
d = json.load(open(sys.argv[1]))
assert [r["mode"] for r in d["results"]] == ["off", "fixed", "paused"], d["results"]
f, p = d["results"][1], d["results"][2]
assert f["drafted"] > 0 and p["drafted"] == 0 and p["same_as_off"] == 2 and f["same_as_off"] == 2, (f, p)
ap = [m for m in d["summary"][0]["speculative"] if m["mode"] == "active_over_paused"]
assert len(ap) == 1 and ap[0]["engine"] == 1 and len(ap[0]["per_round"]) == 2, ap
r = sorted(ap[0]["per_round"])
assert abs(ap[0]["ratio"] - 0.5 * (r[0] + r[1])) < 1e-9, ap
assert abs(r[0] - f["runs"][0] / p["runs"][0]) < 1e-9 or abs(r[0] - f["runs"][1] / p["runs"][1]) < 1e-9, (ap, f, p)
EOF2

# ---- 3. refusals -------------------------------------------------------------------------------------
"$PD_BIN" bench-spec --model "$MODEL" --device cpu --speculative-method draft --golden "$G" >"$TMP/r1" 2>&1 &&
  pd_fail "draft without --speculative-model accepted"
grep -q 'speculative-model' "$TMP/r1" || pd_fail "refusal does not name --speculative-model: $(cat "$TMP/r1")"
"$PD_BIN" bench-spec --model "$MODEL" --device cpu --speculative-method ngram --golden "$G" --modes adaptive,off >"$TMP/r2" 2>&1 &&
  pd_fail "--modes not starting with off accepted"
grep -q 'modes' "$TMP/r2" || pd_fail "refusal does not name --modes: $(cat "$TMP/r2")"
"$PD_BIN" bench-spec --model "$MODEL" --device cpu --speculative-method ngram --golden "$G" --frobnicate 1 >"$TMP/r3" 2>&1 &&
  pd_fail "unknown option accepted"
"$PD_BIN" bench-spec --model "$MODEL" --device cpu --golden "$G" --modes off,bogus:adaptive >"$TMP/r4" 2>&1 &&
  pd_fail "--modes with an unknown method accepted"
grep -q 'bogus' "$TMP/r4" || pd_fail "refusal does not name the bad mode: $(cat "$TMP/r4")"
"$PD_BIN" bench-spec --model "$MODEL" --device cpu --golden "$G" --modes off,adaptive >"$TMP/r5" 2>&1 &&
  pd_fail "adaptive without a method accepted"
grep -q 'speculative-method' "$TMP/r5" || pd_fail "refusal does not name --speculative-method: $(cat "$TMP/r5")"
"$PD_BIN" bench-spec --model "$MODEL" --device cpu --speculative-method ngram --golden "$G" --modes off,paused >"$TMP/r6" 2>&1 &&
  pd_fail "paused without a speculative engine before it accepted"
grep -q 'paused' "$TMP/r6" || pd_fail "refusal does not name paused: $(cat "$TMP/r6")"
"$PD_BIN" bench-spec --model "$MODEL" --device cpu --speculative-method ngram --golden "$G" --modes off,adaptive,paused,paused >"$TMP/r7" 2>&1 &&
  pd_fail "two paused entries for one engine accepted"

# ---- 4. the controlled-acceptance fixture ------------------------------------------------------------
FX="$TMP/fixture"
mkdir -p "$FX"
cp "$MODEL"/tokenizer.json "$MODEL"/tokenizer_config.json "$FX"/
cat >"$FX/config.json" <<'EOF3'
{"architectures":["LlamaForCausalLM"],"hidden_size":512,"intermediate_size":1024,"num_hidden_layers":4,
 "num_attention_heads":8,"num_key_value_heads":2,"vocab_size":4096,"rms_norm_eps":1e-5,"rope_theta":10000.0,
 "tie_word_embeddings":false,"max_position_embeddings":512}
EOF3
fixture() {  # EPS, output name
  PD_SPEC_STATS=1 timeout 300 "$PD_BIN" bench-spec --model "$FX" --device cpu --load-format dummy --speculative-method draft \
    --speculative-model "$FX" --speculative-dummy-layers 1 --dummy-residual-scale "1:$1" --random-prompt 12 \
    --random-prompts 3 --max-tokens 20 --batches 3 --reps 1 --modes off,fixed >"$TMP/$2.out" 2>"$TMP/$2.err" ||
    pd_fail "bench-spec fixture eps $1: $(tail -5 "$TMP/$2.err")"
  grep ' fixed .*batch=3 ' "$TMP/$2.out" || pd_fail "bench-spec fixture eps $1: no result: $(cat "$TMP/$2.out")"
  # The draft's price comes from its steady forwards (1-2 tokens a row): they must reach it.
  grep -Eq 'spec stats: draft forwards: [1-9][0-9]* steady .*steady estimate [1-9]' "$TMP/$2.err" ||
    pd_fail "bench-spec fixture eps $1: no steady draft forward priced: $(grep 'spec stats' "$TMP/$2.err" | head -3)"
}
l=$(fixture 0 fx0)
echo "$l" | grep -q 'acceptance 1.000  tokens/verify [45]\.' || pd_fail "fixture eps 0 did not accept every draft: $l"
echo "$l" | grep -q 'same as off 3/3' || pd_fail "fixture eps 0 differs from plain decoding: $l"
l=$(fixture 1 fx1)
echo "$l" | grep -q 'acceptance 1.000' && pd_fail "fixture eps 1 (unscaled) still accepts every draft: $l"
echo "$l" | grep -q 'same as off 3/3' || pd_fail "fixture eps 1 differs from plain decoding: $l"
refuse() {  # expected message, args...
  want=$1; shift
  "$PD_BIN" bench-spec --model "$FX" --device cpu --random-prompt 8 --max-tokens 4 --batches 1 --reps 1 --speculative-method ngram --modes off "$@" >"$TMP/rf" 2>&1 &&
    pd_fail "accepted: $*"
  grep -q -- "$want" "$TMP/rf" || pd_fail "refusal of '$*' does not say '$want': $(cat "$TMP/rf")"
}
refuse 'need --load-format dummy' --dummy-residual-scale 1:0.1
refuse 'need --load-format dummy' --speculative-method draft --speculative-model "$FX" --speculative-dummy-layers 1
refuse 'FROM_LAYER:EPS' --load-format dummy --dummy-residual-scale 1
refuse 'FROM_LAYER:EPS' --load-format dummy --dummy-residual-scale 1:2
refuse 'FROM_LAYER:EPS' --load-format dummy --dummy-residual-scale -1:0.5
refuse 'copy-chain is a fidelity' --load-format dummy --copy-chain 1.5
refuse 'copy-chain needs --random-prompt L (and the interleaved' --load-format dummy --copy-chain 0.5 --sequential
refuse 'FROM 4 must be 1..3' --load-format dummy --dummy-residual-scale 4:0.5
refuse 'needs --speculative-model' --load-format dummy --speculative-method draft --speculative-dummy-layers 1
export PD_SPEC_PROBE_SHARE=0.5  # the adaptive policy's probe budget knob: a share of the step time in (0, 0.1]
refuse 'PD_SPEC_PROBE_SHARE=0.5' --load-format dummy --modes off,adaptive
export PD_SPEC_PROBE_SHARE=x
refuse 'PD_SPEC_PROBE_SHARE=x' --load-format dummy --modes off,adaptive
unset PD_SPEC_PROBE_SHARE
refuse 'the config has 4 layers' --load-format dummy --speculative-method draft --speculative-model "$FX" \
  --speculative-dummy-layers 5 --modes off,fixed
# ---- 5. the copy workload: a Markov target (every layer's write scaled to 0) decodes the copy in
# its prompt again, so ngram accepts every draft at fidelity 1 (f32: exact) and about half at 0.5;
# outputs identical to plain decoding either way
copy() {  # fidelity name
  timeout 300 "$PD_BIN" bench-spec --model "$FX" --device cpu --load-format dummy --dummy-residual-scale 0:0 --copy-chain "$1" \
    --random-prompt 8 --random-prompts 2 --max-tokens 24 --batches 1 --serial 2 --reps 1 --num-speculative-tokens 4 \
    --modes off,ngram:fixed >"$TMP/$2.out" 2>"$TMP/$2.err" || pd_fail "copy workload $1: $(tail -3 "$TMP/$2.err")"
  grep ' fixed .*batch=1 ' "$TMP/$2.out"
}
c1=$(copy 1 cp1)
grep -q 'copy workload: 2 prompts of 41 tokens' "$TMP/cp1.out" || pd_fail "copy workload prompts: $(cat "$TMP/cp1.out")"
echo "$c1" | grep -q 'acceptance 1.000' || pd_fail "copy workload at fidelity 1 rejected drafts: $c1"
echo "$c1" | grep -q 'same as off 2/2' || pd_fail "copy workload differs from plain decoding: $c1"
c5=$(copy 0.5 cp5)
a5=$(echo "$c5" | sed -E 's/.*implied a ([0-9.]+).*/\1/')
python3 -c "import sys; a = float(sys.argv[1]); assert 0.2 < a < 0.8, a" "$a5" || pd_fail "copy workload at fidelity 0.5: implied a $a5: $c5"
echo "$c5" | grep -q 'same as off 2/2' || pd_fail "copy workload 0.5 differs from plain decoding: $c5"

echo "PASS test_bench_spec: $(grep ' fixed .*batch=1 ' "$TMP/draft.out" | sed 's/  */ /g'); fixture acceptance at eps 0 / 1: $(cat "$TMP/fx0.out" "$TMP/fx1.out" | grep ' fixed ' | grep -o 'acceptance [0-9.]*' | sed 's/acceptance //' | tr '\n' ' ')"
