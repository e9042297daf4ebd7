#!/bin/sh
# One device-tool call for the disaggregation work (build first with tools/gpu/build.sh and
# carry build/gpu/{bin,models}): the outputs-identical check (test_disagg_gpu.sh), then
# bench-handoff over cuda-ipc and nccl (Llama-3-8B shape, dummy weights). Logs go to $OUT.
# env: SKIP_IDENT=1, BENCH_TRANSPORTS ("cuda-ipc nccl"; "" = none), REPS (5), IDENT_S / BENCH_S (timeouts, s)
B=${B:-build/gpu}
O=${OUT:-out}
mkdir -p "$O" /tmp/pdit
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
nvidia-smi -L
nvidia-smi topo -m 2>/dev/null | head -3
if [ "${SKIP_IDENT:-0}" = 0 ]; then
  TMPDIR=/tmp/pdit PD_KEEP_TMP=1 PD_BIN=$PWD/$B/bin/pdserve PD_MODELS_DIR=$PWD/$B/models \
    timeout "${IDENT_S:-240}" sh tools/gpu/test_disagg_gpu.sh >"$O/identical.log" 2>&1
  echo "identical rc=$?" >>"$O/identical.log"
  grep -E "PASS|FAIL|INFO|rc=|NCCL|warn|error" "$O/identical.log" | head -60
  tar czf "$O/identical_tmp.tgz" -C /tmp pdit 2>/dev/null
fi
for tr in ${BENCH_TRANSPORTS-cuda-ipc nccl}; do
  timeout "${BENCH_S:-150}" $B/bin/pdserve bench-handoff --model bench/configs/llama-3-8b --load-format dummy \
    --tokenizer $B/models/kjv-llama-6m --tokens 512,2048,7500 --devices 0,1 --reps "${REPS:-5}" --transport "$tr" \
    --json "$O/handoff_$tr.json" >"$O/handoff_$tr.log" 2>&1
  echo "bench-handoff $tr rc=$?"
  grep -v '^pdserve info' "$O/handoff_$tr.log" | tail -14
done
# NCCL channel-count variant (p2p over NVLink), 7500 tokens only: NCCL_TUNE_ENV="NCCL_MIN_P2P_NCHANNELS=32 ..."
if [ -n "${NCCL_TUNE_ENV:-}" ]; then
  env $NCCL_TUNE_ENV timeout "${BENCH_S:-150}" $B/bin/pdserve bench-handoff --model bench/configs/llama-3-8b \
    --load-format dummy --tokenizer $B/models/kjv-llama-6m --tokens 7500 --devices 0,1 --reps 3 --transport nccl \
    --json "$O/handoff_nccl_tuned.json" >"$O/handoff_nccl_tuned.log" 2>&1
  echo "bench-handoff nccl ($NCCL_TUNE_ENV) rc=$?"
  grep -v '^pdserve info' "$O/handoff_nccl_tuned.log" | tail -5
fi
