#!/bin/sh
# Disaggregated prefill/decode as separate processes on loopback (CPU): a prefill worker and a
# decode worker, over tcp and over shm. Checks, against a colocated `--role both` server:
#   1. greedy outputs are identical for the golden prompts and for 64 concurrent mixed-length
#      requests, and /metrics shows handoffs and zero recomputed prompts (no fallbacks);
#   2. a corrupted KV transfer (--debug-corrupt-kv) is detected and the request still completes
#      correctly (fallback reason "checksum");
#   3. killing the prefill worker (kill -9) in the middle of a load completes every request
#      correctly (fallback reason "worker_died" or "timeout").
. "$(dirname "$0")/lib/server.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is needed"
here=$(cd "$(dirname "$0")" && pwd)

. "$(dirname "$0")/lib/disagg.sh"

# Prompts: the 6 golden prompts + 58 mixed-length slices of the held-out text.
dg_prompts "$TMP/prompts.json" 64 7 3 17 64 90 150 250
dg_token  # the KV connections' shared secret (the workers refuse to start without one)

dg_reference both 16 24 --num-kv-blocks 2048

for tr in tcp shm; do
  dg_start_pair $tr $tr
  python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/$tr.json" --concurrency 16 --max-tokens 24 ||
    pd_fail "$tr run failed"
  dg_compare "$TMP/$tr.json" "$tr" || pd_fail "$tr outputs differ"
  h=$(dg_metric "$URL" '^pdserve_kv_handoffs_total')
  f=$(dg_metric "$URL" '^pdserve_kv_handoff_fallbacks_total')
  [ "$h" -ge 64 ] || pd_fail "$tr: expected >= 64 handoffs, /metrics says $h"
  [ "$f" -eq 0 ] || pd_fail "$tr: expected no recomputed prompts, /metrics says $f fallbacks"
  echo "$tr: $h handoffs, 0 fallbacks"
  pd_stop decode_$tr
  pd_stop prefill_$tr
done

# Corrupted transfers are detected and recomputed, never decoded from.
dg_check_corrupt shm shm
# kill -9 of the prefill worker while requests are in flight: every request still completes.
dg_check_kill tcp tcp
echo "test_disagg: all checks passed"
