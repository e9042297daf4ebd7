#!/bin/sh
# The environment knobs (base/knobs.h, `pdserve env`): every variable the source reads through an
# environment accessor is registered and every registered one is still read; a mistyped value is
# refused at start with the variable named (exit 2, nothing started); an unknown variable of a
# pdserve family gets a warning with the nearest known name; good values pass.
. "$(dirname "$0")/lib/server.sh"
pd_setup
tmp=$TMP  # (pd_setup's, removed by its cleanup)

# 1. the registry and the source agree, both ways
grep -rohE '(getenv|pd_env_switch|pd_env_int|pd_env_double|pd_cuda_env_int|pd_k_env_on|pd_k_env_int|pd_fa_env)\("(PD|PDSERVE)_[A-Z0-9_]+"' \
  "$repo/src" | sed -E 's/.*\("//; s/"$//' | sort -u > "$tmp/src"
env -i PATH="$PATH" "$PD_BIN" env | awk '{print $1}' | sort > "$tmp/reg"
[ "$(wc -l < "$tmp/src")" -gt 50 ] || pd_fail "found only $(wc -l < "$tmp/src") knob reads in src/ (the grep broke?)"
missing=$(comm -23 "$tmp/src" "$tmp/reg")
[ -z "$missing" ] || pd_fail "read in src/ but not registered in src/base/knobs.c: $missing"
stale=$(comm -13 "$tmp/src" "$tmp/reg")
[ -z "$stale" ] || pd_fail "registered in src/base/knobs.c but read nowhere in src/: $stale"
echo "registry: $(wc -l < "$tmp/reg") knobs, the same as the source reads"

# 2. bad values are refused before anything runs, naming the variable
for kv in PD_CUDA_PDL=2 PDSERVE_TIER_RESERVE=yes PD_CUDA_SKINNY=7 PDSERVE_LOG=verbose PD_SPEC_PROBE_SHARE=0.5 PD_UCX_PATH=rdma; do
  rc=0
  env "$kv" "$PD_BIN" model-info --model "$MODEL" > "$tmp/out" 2> "$tmp/err" || rc=$?
  [ "$rc" = 2 ] || pd_fail "$kv: exit $rc, want 2"
  grep -q "${kv}: want" "$tmp/err" || pd_fail "$kv: the refusal does not name it: $(cat "$tmp/err")"
  [ ! -s "$tmp/out" ] || pd_fail "$kv: the command ran anyway"
done
echo "refused: 6 mistyped values, each named"

# 3. an unknown variable of a pdserve family: a warning with the nearest name, and the command runs
PD_CUDA_ATTN_WAVE=2 PDSERVE_TIER_RESERV=1 "$PD_BIN" model-info --model "$MODEL" > "$tmp/out" 2> "$tmp/err" \
  || pd_fail "model-info failed with unknown variables set: $(cat "$tmp/err")"
grep -q "PD_CUDA_ATTN_WAVE is set .*did you mean PD_CUDA_ATTN_WAVES" "$tmp/err" || pd_fail "no typo warning: $(cat "$tmp/err")"
grep -q "PDSERVE_TIER_RESERV is set .*did you mean PDSERVE_TIER_RESERVE" "$tmp/err" || pd_fail "no typo warning: $(cat "$tmp/err")"
[ -s "$tmp/out" ] || pd_fail "model-info printed nothing"
# the test harness's own variables (PD_MODELS_DIR, PD_BIN, ...) are no knob family: no warning
PD_MODELS_DIR=/x PD_KV_FAULT_CYCLES=3 "$PD_BIN" model-info --model "$MODEL" > /dev/null 2> "$tmp/err" || pd_fail "model-info failed"
! grep -q "is set but" "$tmp/err" || pd_fail "warned about a harness variable: $(cat "$tmp/err")"

# 4. good values pass, and `pdserve env --set` shows them
PD_CUDA_PDL=0 PDSERVE_LOG=warn PD_SPEC_PROBE_SHARE=0.003 PD_CUDA_SAMPLE_CLUSTER=4 "$PD_BIN" env --set > "$tmp/out" 2> "$tmp/err" \
  || pd_fail "env --set failed: $(cat "$tmp/err")"
[ "$(wc -l < "$tmp/out")" -ge 4 ] || pd_fail "env --set: $(cat "$tmp/out")"
grep -q "^PD_SPEC_PROBE_SHARE .* 0.003 " "$tmp/out" || pd_fail "env --set does not show the value: $(cat "$tmp/out")"
echo "test_env_knobs: ok"
