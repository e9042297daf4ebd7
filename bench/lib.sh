# bench/lib.sh — shared by the GPU benchmark scripts (sourced; needs $repo).

# dummy_model CONFIG_DIR: a folder with CONFIG_DIR's config.json (dummy weights need nothing else)
# and the bundled tokenizer (prompts are token ids and outputs are counted in tokens, so any
# tokenizer will do); prints its path.
dummy_model() {
  d=$(mktemp -d)/$(basename "$1")
  mkdir -p "$d"
  cp "$repo/$1/config.json" "$repo/models/kjv-llama-6m/tokenizer.json" "$repo/models/kjv-llama-6m/tokenizer_config.json" "$d/"
  echo "$d"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_health URL: up to 120 s for URL/health to answer.
wait_health() {
  i=0
  until curl -sf "$1/health" >/dev/null 2>&1; do
    i=$((i + 1)); [ $i -lt 1200 ] || { echo "no /health at $1" >&2; exit 1; }; sleep 0.1
  done
}
