#!/bin/sh
# `make run`: start the embedded default — the bundled model (models/kjv-llama-6m) served by
# `pdserve run` on http://127.0.0.1:8000: a prefill worker, a decode worker and the router, as three
# supervised processes (a child that dies is restarted; all of them die with `pdserve run`). It
# answers a sample chat request through the router, prints the answer and whether the prompt's KV
# was handed off (bytes and time from the decode worker's counters), the URL and a curl example,
# then keeps serving until Ctrl-C (graceful: running requests finish first, up to 30 s).
# Usage: tools/run.sh [path/to/pdserve] [extra `pdserve run` flags, e.g. --port 8080 or --port 0]
bin="${1:-build/pdserve}"
[ $# -gt 0 ] && shift
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -x "$bin" ]; then
  echo "run.sh: $bin not found; build it with 'make'" >&2
  exit 1
fi
model="${PDSERVE_MODEL:-$repo/models/kjv-llama-6m}"
exec "$bin" run --model "$model" "$@"
