#!/bin/sh
# test_disagg_ucx.sh — the ucx KV transport (--kv-transport ucx, libucx) on loopback (CPU), both
# data paths: put (the prefill worker puts the KV straight into the decode worker's UCX-registered
# pool; the default for host pools) and tag (PD_UCX_PATH=tag: the decode worker posts one tagged
# receive per layer, K|V and block run into its pool, the prefill worker sends them; the default
# for device pools, so it runs here on the CPU too). Checks, against a colocated `--role both`
# server, for put over UCX_TLS=tcp,self and tcp,sm,self, tag over tcp,self and over sm,self with
# UCX_POSIX_ERROR_HANDLING=y (UCX 1.13's shared-memory transports report no peer failure unless
# told to, and our endpoints ask for peer error handling: sm,self alone is "Destination is
# unreachable"):
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

# tag+gather: PD_UCX_FORCE_GATHER=1 (test hook) sends every save from the staging copy that a
# request whose source blocks are not consecutive needs (rare on an idle prefill worker).
for run in put:tcp,self put:tcp,sm,self tag:tcp,self tag:sm,self tag+gather:tcp,self; do
  path=${run%%:*}
  export PD_UCX_PATH=${path%+gather} UCX_TLS=${run#*:} UCX_POSIX_ERROR_HANDLING=n UCX_SYSV_ERROR_HANDLING=n \
    PD_UCX_FORCE_GATHER=0
  [ "$UCX_TLS" = sm,self ] && export UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y
  [ "$path" = tag+gather ] && export PD_UCX_FORCE_GATHER=1
  tr=ucx_$(echo $path | tr + _)_$(echo $UCX_TLS | tr , _)
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
  if [ "$PD_UCX_FORCE_GATHER" = 1 ]; then
    grep -q 'sent from a staging copy' "$TMP/prefill_$tr.err" || pd_fail "$tr: no save went through the staging copy"
  fi
  pd_stop decode_$tr
  pd_stop prefill_$tr
done
export UCX_TLS=tcp,self UCX_POSIX_ERROR_HANDLING=n UCX_SYSV_ERROR_HANDLING=n PD_UCX_FORCE_GATHER=0
for path in put tag; do
  export PD_UCX_PATH=$path
  dg_check_corrupt ucx_corrupt_$path ucx
  dg_check_kill ucx_kill_$path ucx
done
# 4. tag path, a message one row short / one row long (PD_UCX_DEBUG_LENGTH, every 3rd save): the
#    decode worker checks each receive against what it posted, fails that load (fallback "error",
#    prefilled locally) and every output is still identical. The failed load's other receives are
#    cancelled while their messages still arrive: before the decode worker serialized its cancels
#    with its progress (ucx.c, wk_mu), UCX 1.13 aborted it here in about 4 runs of 10 (an assertion
#    in ucp_tag_exp_remove; every client saw "Remote end closed connection"). It must outlive each case.
export PD_UCX_PATH=tag
for len in short long; do
  export PD_UCX_DEBUG_LENGTH=$len
  tr=ucx_len_$len
  dg_start_pair $tr ucx
  python3 "$here/disagg_client.py" "$URL" "$TMP/prompts.json" "$TMP/$tr.json" --concurrency 16 --max-tokens 24 ||
    pd_fail "$tr run failed"
  if ! kill -0 "$(cat "$TMP/decode_$tr.pid")" 2>/dev/null || grep -q 'Assertion' "$TMP/decode_$tr.err"; then
    tail -20 "$TMP/decode_$tr.err" >&2
    pd_fail "$tr: the decode worker died (above: the end of its log)"
  fi
  dg_compare "$TMP/$tr.json" "$tr" || pd_fail "$tr outputs differ"
  e=$(dg_metric "$URL" 'pdserve_kv_handoff_fallbacks_total.*reason="error"')
  f=$(dg_metric "$URL" '^pdserve_kv_handoff_fallbacks_total')
  h=$(dg_metric "$URL" '^pdserve_kv_handoffs_total')
  [ "$e" -ge 1 ] && [ "$e" -eq "$f" ] || pd_fail "$tr: expected only 'error' fallbacks (>= 1), got $e of $f"
  want='of [0-9]* bytes, [0-9]* posted'
  [ $len = long ] && want='truncated'
  grep -qi "$want" "$TMP/decode_$tr.err" || pd_fail "$tr: the decode worker did not report the bad length ($want)"
  echo "$tr: $e loads refused for a bad message length, $h handoffs"
  pd_stop decode_$tr
  pd_stop prefill_$tr
done
unset PD_UCX_DEBUG_LENGTH
echo "PASS test_disagg_ucx"
