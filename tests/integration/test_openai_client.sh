#!/bin/sh
# test_openai_client.sh — pdserve through the official `openai` npm package (exit 0 = pass).
# The client is installed by make deps (npm ci in tests/integration/js, from the lockfile); this
# test installs nothing. It runs js/openai_client.mjs against a server on a free port: completions and chat, streaming and
# not, usage, n, stop, logprobs, and the client's error classes.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
command -v node >/dev/null || pd_fail "node is required"
[ -d "$here/js/node_modules/openai" ] ||
  pd_fail "the openai npm client is missing in tests/integration/js/node_modules (make deps runs npm ci)"
pd_start A --num-kv-blocks 512 --served-model-name kjv-llama-6m
node "$here/js/openai_client.mjs" "$URL" kjv-llama-6m || pd_fail "openai client checks"
pd_stop A
echo "test_openai_client.sh: PASS"
