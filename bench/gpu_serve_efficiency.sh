#!/bin/sh
# bench/gpu_serve_efficiency.sh — how much of its own engine's batched decode throughput the HTTP
# server delivers (llama.cpp's server delivers 16–30% of its engine's under 32–64 streams).
# Llama-3-8B shape, dummy weights, one GPU: `pdserve bench` closed-loop at 32 and 64 concurrent
# streams (256 prompt tokens, 256 output tokens, ignore_eos), next to `pdserve bench-engine`'s
# decode step time at the same batch sizes, measured in the same call.
# usage: bench/gpu_serve_efficiency.sh OUT     (PDSERVE=binary, default build/pdserve)
set -eu
out=$1
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${PDSERVE:-$repo/build/pdserve}
. "$repo/bench/lib.sh"
mkdir -p "$out"
model=$(dummy_model bench/configs/llama-3-8b)
"$bin" bench-engine --model "$model" --load-format dummy --json "$out/engine.json" > "$out/engine.txt" 2>&1
port=$(free_port)
"$bin" serve --model "$model" --load-format dummy --port "$port" --kv-cache-memory 40G --no-prefix-caching > "$out/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT INT TERM
wait_health "http://127.0.0.1:$port"
for c in 32 64; do
  "$bin" bench --url "http://127.0.0.1:$port" --dataset random --input-len 256 --output-len 256 \
    --num-prompts $((c * 3)) --max-concurrency $c --request-rate inf --seed $c --quiet --return-token-ids \
    --output-json "$out/serve_c$c.json" | tee "$out/serve_c$c.txt"
done
