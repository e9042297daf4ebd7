#!/bin/sh
# test_openai_client.sh — pdserve through the official `openai` npm package (exit 0 = pass).
# Installs tests/integration/js/node_modules from package.json on first run (npm registry), then
# runs js/openai_client.mjs against a server on a free port: completions and chat, streaming and
# not, usage, n, stop, logprobs, and the client's error classes.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
command -v node >/dev/null || pd_fail "node is required"
if [ ! -d "$here/js/node_modules/openai" ]; then
  command -v npm >/dev/null || pd_fail "npm is required to install the openai client"
  (cd "$here/js" && npm install --no-audit --no-fund --silent) || pd_fail "npm install failed"
fi
pd_start A --num-kv-blocks 512 --served-model-name kjv-llama-6m
node "$here/js/openai_client.mjs" "$URL" kjv-llama-6m || pd_fail "openai client checks"
pd_stop A
echo "test_openai_client.sh: PASS"
