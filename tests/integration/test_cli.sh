#!/bin/sh
# The offline CLI against the golden files: tokenize ids, generate (greedy, json) tokens, model-info,
# stop strings, and clear errors for bad input.
. "$(dirname "$0")/lib/server.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is required"
G="${PD_MODELS_DIR:-$repo/../shared/models}/golden"
[ -e "$G/kjv-llama-6m.json" ] || pd_fail "golden files not found at $G"

# tokenize: the KJV passage case and a special-token case, with and without special tokens
python3 - "$PD_BIN" "$MODEL" "$G/tokenize.json" <<'PY' || exit 1
import json, subprocess, sys
bin_, model, path = sys.argv[1:4]
cases = json.load(open(path))["cases"]
n = 0
for c in cases:
    if not c["text"] or "\x00" in c["text"]:
        continue
    out = subprocess.run([bin_, "tokenize", "--model", model, c["text"]], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == c["ids_with_special"], (c["name"], out)
    out = subprocess.run([bin_, "tokenize", "--model", model, "--no-special", c["text"]], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == c["ids"], (c["name"], out)
    n += 1
print("tokenize: %d golden cases match" % n)
PY

# generate: greedy continuation of every golden prompt equals transformers' (48 tokens, up to the
# first near-tie step, as the golden README allows)
python3 - "$PD_BIN" "$MODEL" "$G/kjv-llama-6m.json" <<'PY' || exit 1
import json, subprocess, sys
bin_, model, path = sys.argv[1:4]
for p in json.load(open(path))["prompts"]:
    out = subprocess.run([bin_, "generate", "--model", model, "--device", "cpu", "--prompt-ids", ",".join(map(str, p["prompt_ids"])),
                          "--max-tokens", "48", "--temperature", "0", "--ignore-eos", "--output", "json"],
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["prompt_ids"] == p["prompt_ids"]
    want, steps = p["greedy"]["new_ids"], p["greedy"]["steps"]
    k = next((i for i, s in enumerate(steps) if s["margin"] < 1e-3), len(want))
    assert got["output_ids"][:k] == want[:k], (p["name"], got["output_ids"], want)
print("generate: 6 golden prompts match")
PY

# --prompt text with BOS, a stop string, model-info
out=$("$PD_BIN" generate --model "$MODEL" --device cpu --prompt "In the beginning God" --max-tokens 64 --temperature 0 \
      --stop "world" --output json) || pd_fail "generate --prompt failed"
echo "$out" | python3 -c 'import json,sys; o=json.load(sys.stdin); assert o["prompt_ids"][:1]==[4092], o; assert "world" not in o["text"] and o["finish_reason"]=="stop", o; print("stop string: ok:", repr(o["text"]))' ||
  pd_fail "stop string"
"$PD_BIN" model-info --model "$MODEL" | python3 -c 'import json,sys; o=json.load(sys.stdin); assert o["architecture"]=="LlamaForCausalLM" and o["layers"]==6 and o["kv_bytes_per_token_bf16"]==6*2*2*64*2, o; print("model-info: ok")' ||
  pd_fail "model-info"

# bad input: clear messages, non-zero exit, nothing printed on stdout
err=$("$PD_BIN" generate --model /nonexistent --prompt x 2>&1 >/dev/null) && pd_fail "missing model accepted"
echo "$err" | grep -q "/nonexistent/tokenizer.json\|/nonexistent/config.json" || pd_fail "missing model: unclear error: $err"
err=$("$PD_BIN" generate --model "$MODEL" --prompt x --temperature -1 2>&1) && pd_fail "negative temperature accepted"
echo "$err" | grep -q "temperature" || pd_fail "bad temperature: unclear error: $err"
err=$("$PD_BIN" generate --model "$MODEL" --prompt-ids 1,x 2>&1) && pd_fail "bad ids accepted"
echo "$err" | grep -q "prompt-ids" || pd_fail "bad ids: unclear error: $err"
echo "test_cli: all checks passed"
