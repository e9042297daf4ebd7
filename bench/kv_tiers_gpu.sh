#!/bin/sh
# bench/kv_tiers_gpu.sh OUT [DIR] — the KV tiers on one GPU (issue 14): Llama-3-8B shape (dummy
# weights), a device pool deliberately limited (--num-kv-blocks, default 384 blocks = 6144 tokens),
# a multi-turn chat workload (bench/kv_tiers_chat.py: 200 conversations x 8 turns, 16 live, a
# shared 256-token system prompt, histories growing by 128 tokens a turn: ~15k blocks over the run,
# ~1250 blocks live, 3x the pool), run with tiers off, with a host DRAM tier, and with DRAM + disk;
# and, in the same run, the host->device / device->host bandwidths and the tiers' own staging copy
# (tier_bw) and the disk's O_DIRECT read / write bandwidth (dd). DIR: a folder holding pdserve,
# tier_bw, kv_tiers_chat.py, lib/, llama-3-8b/ (config + any tokenizer) (default: this script's).
# Env: BLOCKS, DEADLINE (s per config, default 90), CONV (200), DRAM (16G), DRAM2 (2G), DISK (24G),
# CASES (the configurations run, default "off dram dram_disk"), ARGS (more serve flags for every
# configuration, e.g. "--policy fcfs"), CHAT_ARGS (more flags for bench/kv_tiers_chat.py, e.g.
# --keepalive: one kept-alive connection per client thread), BW=0 (skip the bandwidth measurements).
set -u
OUT=$1
D=${2:-$(cd "$(dirname "$0")" && pwd)}
export LD_LIBRARY_PATH="$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BLOCKS=${BLOCKS:-384}; DEADLINE=${DEADLINE:-90}; CONV=${CONV:-200}
DRAM=${DRAM:-16G}; DRAM2=${DRAM2:-2G}; DISK=${DISK:-24G}; CASES=${CASES:-off dram dram_disk}; ARGS=${ARGS:-}; BW=${BW:-1}
W=$(mktemp -d /tmp/kvtiers.XXXXXX)
mkdir -p "$OUT"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$W/tok"; chmod 600 "$W/tok"
if [ "$BW" != 0 ]; then
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv >"$OUT/bw.txt" 2>&1
"$D/tier_bw" 256 >>"$OUT/bw.txt" 2>&1
# disk: 2 GiB written and read back with O_DIRECT, 2 MiB blocks (a bf16 page of this model)
df -h /tmp >>"$OUT/bw.txt" 2>&1
dd if=/dev/urandom of="$W/src" bs=2M count=256 2>/dev/null
dd if="$W/src" of="$W/dd" bs=2M oflag=direct conv=fsync 2>&1 | tail -1 | sed 's/^/disk write O_DIRECT 2M: /' >>"$OUT/bw.txt"
sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null
dd if="$W/dd" of=/dev/null bs=2M iflag=direct 2>&1 | tail -1 | sed 's/^/disk read O_DIRECT 2M: /' >>"$OUT/bw.txt"
rm -f "$W/src" "$W/dd"
cat "$OUT/bw.txt"
fi

run_cfg() {  # run_cfg LABEL FLAGS...
  label=$1; shift
  "$D/pdserve" serve --model "$D/llama-3-8b" --load-format dummy --port 0 --num-kv-blocks "$BLOCKS" \
    --auth-token-file "$W/tok" $ARGS "$@" >"$W/$label.out" 2>"$W/serve_$label.log" &
  pid=$!
  i=0; URL=
  while [ $i -lt 1200 ]; do
    URL=$(grep -o 'http://[0-9.]*:[0-9]*' "$W/$label.out" 2>/dev/null | head -1)
    [ -n "$URL" ] && curl -sf "$URL/health" >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || break
    i=$((i + 1)); sleep 0.1
  done
  if [ -n "$URL" ] && curl -sf "$URL/health" >/dev/null 2>&1; then
    python3 "$D/kv_tiers_chat.py" "$URL" "$label" "$OUT/chat_$label.json" --conversations "$CONV" --turns 8 \
      --concurrency 16 --system 256 --user 96 --assistant 32 --vocab 4000 --deadline "$DEADLINE" ${CHAT_ARGS:-} 2>&1 | tee -a "$OUT/summary.txt"
    curl -sf "$URL/metrics" | grep -E '^pdserve_(kv_tier|prompt_tokens|prefill_tokens|engine_steps)' >"$W/m_$label.txt"
  else
    echo "$label: the server did not come up" | tee -a "$OUT/summary.txt"
  fi
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  { echo "== $label"; grep -v "^pdserve debug" "$W/serve_$label.log" | tail -40; } >>"$OUT/serve_tail.txt"
}
for c in $CASES; do
  case $c in
    off) run_cfg off ;;
    dram) run_cfg dram --kv-offload-dram "$DRAM" ;;
    dram_disk) run_cfg dram_disk --kv-offload-dram "$DRAM2" --kv-offload-disk "$W/disk" --kv-offload-disk-size "$DISK" --kv-offload-dtype bf16 ;;
    *) echo "unknown case $c (off, dram, dram_disk)" | tee -a "$OUT/summary.txt" ;;
  esac
done
for f in "$W"/m_*.txt; do echo "== $f"; cat "$f"; done >"$OUT/metrics.txt" 2>/dev/null
# the greedy first tokens, configuration against tiers off (dram: lossless f32 pages; disk: bf16 pages)
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, os, sys
d = sys.argv[1]
try:
    ref = json.load(open(os.path.join(d, "chat_off.json")))["outputs"]
except Exception as e:
    sys.exit("no reference outputs: %s" % e)
for lab in ("dram", "dram_disk"):
    try:
        got = json.load(open(os.path.join(d, "chat_%s.json" % lab)))["outputs"]
    except Exception as e:
        print("%s: no outputs (%s)" % (lab, e)); continue
    common = [k for k in got if k in ref]
    same = sum(got[k] == ref[k] for k in common)
    print("%s: greedy first token identical to tiers off in %d of %d requests" % (lab, same, len(common)))
PY
rm -rf "$W"
cat "$OUT/summary.txt"
