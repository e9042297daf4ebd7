#!/bin/sh
# `make run`: start the embedded default — the bundled model (models/kjv-llama-6m) served on
# http://127.0.0.1:8000 — answer a sample chat request through the server's own HTTP API, print
# the answer, the URL and a curl example, then keep serving until Ctrl-C.
# Usage: tools/run.sh [path/to/pdserve] [extra `pdserve run` flags, e.g. --port 8080]
bin="${1:-build/pdserve}"
[ $# -gt 0 ] && shift
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -x "$bin" ]; then
  echo "run.sh: $bin not found; build it with 'make'" >&2
  exit 1
fi
model="${PDSERVE_MODEL:-$repo/models/kjv-llama-6m}"
exec "$bin" run --model "$model" "$@"
