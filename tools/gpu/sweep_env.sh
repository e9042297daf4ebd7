#!/bin/sh
# Runs `pdserve bench-engine` once per environment setting and prints one line per setting with
# every measurement's time and ratio to its floor, so knobs (PD_CUDA_*) can be compared within one
# device call, on one card.
# usage: tools/gpu/sweep_env.sh PDSERVE OUT_DIR "ENV1" "ENV2" ... [-- bench-engine args]
#   e.g. tools/gpu/sweep_env.sh build/gpu/bin/pdserve $OUT "PD_CUDA_L2_PREFETCH_MB=0" \
#        "PD_CUDA_L2_PREFETCH_MB=8" -- --only decode
# Default bench-engine args: --model bench/configs/llama-3-8b --load-format dummy --only decode.
set -u
bin=$1 out=$2
shift 2
envs=""
n=0
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  n=$((n + 1))
  eval "env_$n=\$1"
  shift
done
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- --model bench/configs/llama-3-8b --load-format dummy --only decode
mkdir -p "$out"
i=1
while [ $i -le $n ]; do
  eval "e=\$env_$i"
  tag=$(echo "$e" | tr -c 'A-Za-z0-9=_.\n' '_' | tr '=' '-')
  # shellcheck disable=SC2086
  env $e "$bin" bench-engine "$@" --json "$out/sweep_$tag.json" > "$out/sweep_$tag.txt" 2>&1
  printf '%s (rc %s):' "$e" "$?"
  python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
rows = d.get("results", d) if isinstance(d, dict) else d
print(" " + "  ".join("%s %.3f ms %.3fx" % (r.get("label", "?"), r["ms"], r["ms"] / r["floor_ms"]) for r in rows))
' "$out/sweep_$tag.json" 2>/dev/null || echo " (no json)"
  i=$((i + 1))
done
