#!/bin/sh
# bench/compare.sh — benchmark several `pdserve serve` configurations with one workload and put
# them in one report (one line per configuration in every chart).
#
# usage: bench/compare.sh OUTDIR "LABEL|SERVE FLAGS" ["LABEL|SERVE FLAGS" ...] [-- BENCH FLAGS]
#
#   bench/compare.sh /tmp/cmp "prefix cache|" "no prefix cache|--no-prefix-caching" -- \
#       --dataset shared-prefix --prefix-len 256 --suffix-len 32 --output-len 32 \
#       --num-prompts 60 --sweep-rates 2,4,8,16 --goodput ttft:500 tpot:100
#
# For each configuration: start the server on a free port, wait until it listens, run
# `pdserve bench --label LABEL --output-json OUTDIR/<i>.json BENCH FLAGS`, stop the server. Then
# `pdserve bench merge` writes OUTDIR/report.html and OUTDIR/svg/*.svg.
# Environment: PDSERVE (binary, default build/pdserve), MODEL (default models/kjv-llama-6m),
# SERVE_TIMEOUT_S (start-up limit, default 120).
set -eu
[ $# -ge 2 ] || { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${PDSERVE:-$repo/build/pdserve}
model=${MODEL:-$repo/models/kjv-llama-6m}
out=$1
shift
mkdir -p "$out"

# Configurations first (kept as cfg_1, cfg_2, ...), then "$@" is left holding the bench flags.
n=0
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  n=$((n + 1))
  eval "cfg_$n=\$1"
  shift
done
[ $# -gt 0 ] && shift  # the "--"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; true' EXIT INT TERM

jsons=""
i=0
while [ $i -lt $n ]; do
  i=$((i + 1))
  eval "cfg=\$cfg_$i"
  label=${cfg%%|*}
  flags=${cfg#*|}
  [ "$flags" = "$cfg" ] && flags=""
  log="$out/serve-$i.log"
  echo "== [$i/$n] $label: pdserve serve $flags" >&2
  # shellcheck disable=SC2086 # the serve flags are meant to split into words
  "$bin" serve --model "$model" --port 0 $flags > "$log" 2>&1 &
  pid=$!
  t=$(( ${SERVE_TIMEOUT_S:-120} * 10 ))
  while ! grep -q 'on http://' "$log" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "server exited:" >&2; tail -5 "$log" >&2; exit 1; }
    t=$((t - 1))
    [ $t -gt 0 ] || { echo "server did not start in time" >&2; exit 1; }
    sleep 0.1
  done
  url=$(sed -n 's|.* on \(http://[0-9.:]*\).*|\1|p' "$log" | head -1)
  "$bin" bench --url "$url" --label "$label" --output-json "$out/$i.json" "$@" | tee "$out/summary-$i.txt"
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  pid=""
  jsons="$jsons $out/$i.json"
done

# shellcheck disable=SC2086 # one word per file
"$bin" bench merge --output-html "$out/report.html" --output-svg-dir "$out/svg" $jsons
