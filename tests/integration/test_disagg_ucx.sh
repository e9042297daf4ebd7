#!/bin/sh
# test_disagg_ucx.sh — the ucx KV transport (--kv-transport ucx, libucx) on loopback (CPU): a
# prefill worker puts the KV straight into the decode worker's UCX-registered pool. Checks, against
# a colocated `--role both` server, for UCX_TLS=tcp,self and UCX_TLS=tcp,sm,self (sm alone
# cannot reach the other process in our containers: "Destination is unreachable"):
#   1. greedy outputs are identical for the golden prompts and 64 concurrent mixed-length requests,
#      /metrics shows >= 64 handoffs and no fallback;
#   2. a corrupted transfer (--debug-corrupt-kv: one flipped bit put remotely) is caught by the
#      checksum and recomputed;
#   3. kill -9 of the prefill worker during a load: every request still completes correctly.
. "$(dirname "$0")/lib/server.sh"
pd_setup
command -v python3 >/dev/null || pd_fail "python3 is needed"
here=$(cd "$(dirname "$0")" && pwd)

. "$(dirname "$0")/lib/disagg.sh"

# Prompts: the 6 golden prompts + 58 mixed-length slices of the held-out text.
dg_prompts "$TMP/prompts.json" 64 7 3 17 64 90 150 250
dg_token  # the KV connections' shared secret (the workers refuse to start without one)

dg_reference both 16 24 --num-kv-blocks 2048

for tls in tcp,self tcp,sm,self; do
  export UCX_TLS=$tls
  tr=ucx_$(echo $tls | tr , _)
  dg_start_pair $tr ucx
  python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/$tr.json" --concurrency 16 --max-tokens 24 ||
    pd_fail "$tr run failed"
  dg_compare "$TMP/$tr.json" "$tr" || pd_fail "$tr outputs differ"
  h=$(dg_metric "$URL" '^pdserve_kv_handoffs_total')
  f=$(dg_metric "$URL" '^pdserve_kv_handoff_fallbacks_total')
  b=$(dg_metric "$URL" '^pdserve_kv_handoff_bytes_total')
  [ "$h" -ge 64 ] || pd_fail "$tr: expected >= 64 handoffs, /metrics says $h"
  [ "$f" -eq 0 ] || pd_fail "$tr: expected no recomputed prompts, /metrics says $f fallbacks"
  echo "$tr: $h handoffs, $b KV bytes, 0 fallbacks"
  pd_stop decode_$tr
  pd_stop prefill_$tr
done
export UCX_TLS=tcp,self

dg_check_corrupt ucx_corrupt ucx
dg_check_kill ucx_kill ucx
echo "PASS test_disagg_ucx"
