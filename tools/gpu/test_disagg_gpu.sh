#!/bin/sh
# GPU check of disaggregated prefill/decode (needs 2 GPUs of one host): outputs identical to
# colocated. For each golden model (kjv-llama-6m, tiny-random-qwen2), against a colocated
# `--role both` server on cuda:0, with a prefill worker on cuda:0 and a decode worker on cuda:1
# (--disagg-min-tokens 1: every prompt is handed off), for each transport (cuda-ipc, nccl):
#   1. strict, one sequence per engine step and no prefix cache on every server (--max-num-seqs 1
#      --no-prefix-caching: every prompt computed whole, alone, on both sides): greedy completions of
#      the golden prompts (one at a time) and of 64 mixed-length prompts (16 requests in flight)
#      are byte-identical to colocated; /metrics shows handoffs > 0 and zero fallbacks;
#   2. batched (--max-num-seqs 64, 16 requests in flight): handoffs > 0 and zero fallbacks (every
#      handoff's KV verified bit-exact by the per-layer checksums). The completions are compared too
#      but only reported (INFO): bf16 GPU kernels are not batch-invariant (a row's rounding depends
#      on the batch it is computed in), so batched outputs may differ on low-margin tokens — the
#      colocated server itself differs between batched and one-at-a-time runs, printed as a control.
#      (The same holds for prefix-cache hits: a prompt whose first blocks were cached by an earlier,
#      differently shaped computation may round differently; the two setups hit different caches);
#   3. nccl and ucx with --debug-corrupt-kv 3 (one sequence per step): the corrupted slabs are caught
#      by the checksum (fallbacks with reason "checksum" > 0) and the completions are still identical.
# ucx (PD_GPU_TRANSPORTS=ucx) needs, in both servers' environment, a CUDA-enabled UCX (e.g. UCX
# 1.13.1 from tools/gpu/ucx_cuda.sh through LD_LIBRARY_PATH) and UCX_TLS=cuda_ipc,cuda_copy,tcp,self:
# device pools take the two-sided tag path (src/kvconn/ucx.c; docs/benchmarks.md, "UCX on one GPU").
# Prints one PASS/FAIL (or INFO) line per check and exits 1 on any FAIL.
#   usage: tools/gpu/test_disagg_gpu.sh
#   env:   PD_BIN (default build/pdserve), PD_MODELS_DIR (default ../shared/models),
#          PD_GPU_TRANSPORTS (default "cuda-ipc nccl"), PD_GPU_MODELS (default "kjv-llama-6m tiny-random-qwen2"),
#          PD_DEV_PREFILL / PD_DEV_DECODE (default cuda:0 / cuda:1; cpu + PD_GPU_TRANSPORTS=shm: dry run)
# Device tool: build with tools/gpu/build.sh, carry build/gpu/bin and build/gpu/models, then
#   PD_BIN=build/gpu/bin/pdserve PD_MODELS_DIR=build/gpu/models sh tools/gpu/test_disagg_gpu.sh
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
export PD_REPO_DIR="$repo"
export NCCL_NVLS_ENABLE=0  # never NVLink multicast (shared machines)
. "$repo/tests/integration/lib/server.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is needed"
dev_a="${PD_DEV_PREFILL:-cuda:0}" dev_b="${PD_DEV_DECODE:-cuda:1}"  # cpu/cpu + shm: a dry run of this script
if [ "$dev_b" = cuda:1 ]; then
  n_gpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "${n_gpu:-0}" -ge 2 ] || pd_fail "2 GPUs are needed, nvidia-smi lists ${n_gpu:-0}"
fi
models_dir="${PD_MODELS_DIR:-$repo/../shared/models}"
client="$repo/tests/integration/disagg_client.py"
n_fail=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; n_fail=$((n_fail + 1)); }

metric() {  # metric URL NAME_REGEX: sums the matching samples
  curl -sf "$1/metrics" | awk -v re="$2" '$1 ~ re {s += $2} END {print s + 0}'
}

compare() {  # compare REF.json OUT.json LABEL [info]: prints PASS/FAIL (INFO: never fails)
  if python3 - "$1" "$2" "$3" "${4:-}" <<'PY'; then :; else n_fail=$((n_fail + 1)); fi
import json, sys
ref, got, label, info = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4] == "info"
if got["errors"]:
    print("FAIL %s: %d requests failed: %s" % (label, got["errors"], got["error_list"]))
    sys.exit(1)
bad = [i for i, (a, b) in enumerate(zip(ref["texts"], got["texts"])) if a != b]
if info:
    print("INFO %s: %d of %d outputs byte-identical%s" % (label, len(ref["texts"]) - len(bad), len(ref["texts"]),
          " (differ: %s)" % bad if bad else ""))
    sys.exit(0)
if bad or len(ref["texts"]) != len(got["texts"]):
    i = bad[0] if bad else 0
    print("FAIL %s: %d of %d outputs differ from colocated (first: #%d: %r vs %r)"
          % (label, len(bad), len(ref["texts"]), i, ref["texts"][i][:60], got["texts"][i][:60]))
    sys.exit(1)
print("PASS %s: %d outputs byte-identical to colocated" % (label, len(ref["texts"])))
PY
}

run_set() {  # run_set URL TAG: golden prompts one at a time, then the 64 mixed ones 16 at a time
  python3 "$client" "$1" "$TMP/$m.golden.json" "$TMP/$2.golden.out" --concurrency 1 --max-tokens 32 &&
    python3 "$client" "$1" "$TMP/$m.mixed.json" "$TMP/$2.mixed.out" --concurrency 16 --max-tokens 24
}

seq_flags="--num-kv-blocks 4096 --max-num-seqs 1 --no-prefix-caching"
batch_flags="--num-kv-blocks 4096 --max-num-seqs 64"

for m in ${PD_GPU_MODELS:-kjv-llama-6m tiny-random-qwen2}; do
  MODEL="$models_dir/$m"
  [ -e "$MODEL/config.json" ] || { fail "$m: model not found in $models_dir"; continue; }
  python3 - "$models_dir/golden/$m.json" "$TMP/$m.golden.json" "$TMP/$m.mixed.json" <<'PY'
import json, random, sys
g, golden_out, mixed_out = sys.argv[1:4]
prompts = [p["prompt_ids"] for p in json.load(open(g))["prompts"]]
json.dump(prompts, open(golden_out, "w"))
base = max(prompts, key=len)
rng = random.Random(11)
mixed = []
while len(mixed) < 64:
    n = rng.choice([3, 17, 64, 90, 150, 250])
    s = rng.randrange(0, max(1, len(base) - n))
    mixed.append(base[s:s + n])
json.dump(mixed, open(mixed_out, "w"))
PY
  for mode in seq batch; do
    flags=$seq_flags
    [ $mode = batch ] && flags=$batch_flags
    pd_start both --device "$dev_a" $flags
    run_set "$URL" "$m.ref.$mode" || fail "$m: colocated reference run ($mode) failed"
    pd_stop both
  done
  compare "$TMP/$m.ref.seq.mixed.out" "$TMP/$m.ref.batch.mixed.out" "$m control: colocated batched vs one-sequence steps" info
  for tr in ${PD_GPU_TRANSPORTS:-cuda-ipc nccl}; do
    for mode in seq batch corrupt; do
      [ $mode = corrupt ] && [ $tr != nccl ] && [ $tr != ucx ] && continue
      flags=$seq_flags extra="" label="$m $tr" ref=seq
      [ $mode = batch ] && flags=$batch_flags label="$m $tr batched" ref=batch
      [ $mode = corrupt ] && extra="--debug-corrupt-kv 3" label="$m $tr corrupted-slabs"
      tag="$m.$tr.$mode"
      [ -e "$TMP/token" ] || (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/token")
      pd_start pf --role prefill --device "$dev_a" --kv-port 0 --auth-token-file "$TMP/token" $flags $extra
      kv=$(grep -o 'KV port [0-9.]*:[0-9]*' "$TMP/pf.out" | head -1 | awk '{print $3}')
      pd_start dc --role decode --device "$dev_b" --prefill "$kv" --kv-transport $tr --disagg-min-tokens 1 \
        --disagg-timeout-ms 20000 --auth-token-file "$TMP/token" $flags
      if ! pd_wait_for 30 sh -c "curl -sf '$URL/metrics' | grep -q '^pdserve_kv_prefill_workers_healthy 1'"; then
        fail "$label: the decode worker never connected to the prefill worker"
        tail -5 "$TMP/dc.err" "$TMP/pf.err"
      elif ! run_set "$URL" "$tag"; then
        fail "$label: requests failed"
      else
        strict=""
        [ $mode = batch ] && strict=info
        compare "$TMP/$m.ref.$ref.golden.out" "$TMP/$tag.golden.out" "$label golden prompts" $strict
        compare "$TMP/$m.ref.$ref.mixed.out" "$TMP/$tag.mixed.out" "$label 64 mixed (16 in flight)" $strict
        h=$(metric "$URL" '^pdserve_kv_handoffs_total')
        f=$(metric "$URL" '^pdserve_kv_handoff_fallbacks_total')
        c=$(metric "$URL" 'pdserve_kv_handoff_fallbacks_total.*reason="checksum"')
        if [ $mode != corrupt ]; then
          if [ "$h" -gt 0 ] && [ "$f" -eq 0 ]; then pass "$label metrics: $h handoffs, 0 fallbacks"
          else fail "$label metrics: $h handoffs, $f fallbacks"; fi
        else
          if [ "$c" -gt 0 ] && [ "$f" -eq "$c" ]; then pass "$label: $c corrupted slabs caught by the checksum, $h handoffs"
          else fail "$label: $c checksum fallbacks of $f, $h handoffs"; fi
        fi
      fi
      grep -h 'nccl\|warn' "$TMP/dc.err" "$TMP/pf.err" 2>/dev/null | grep -v 'KV checksum mismatch' | head -4
      pd_stop dc
      pd_stop pf
    done
  done
done
if [ $n_fail -eq 0 ]; then echo "test_disagg_gpu: PASS"; else echo "test_disagg_gpu: FAIL ($n_fail checks)"; exit 1; fi
