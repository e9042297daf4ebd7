#!/bin/sh
# bench/mask_cost.sh [TOKENIZER_DIR] [mask_cost options] — the per-step cost of structured-output
# token masks at batch 64 (bench/mask_cost.c says what is measured). CPU only.
#
# Without TOKENIZER_DIR it measures Llama 3's real vocabulary (128,000 BPE tokens + 256 special):
# the tokenizer data comes from the npm package llama3-tokenizer-js (MIT), installed into a
# temporary folder (the npm registry must be reachable), and bench/llama3_vocab.mjs writes a
# Hugging Face tokenizer.json from it on the Llama 3 pipeline that the bundled tokenizer spells.
# Example: sh bench/mask_cost.sh                      (Llama 3 vocabulary, batch 64, 300 steps)
#          sh bench/mask_cost.sh models/kjv-llama-6m  (the bundled 4k vocabulary)
set -e
repo=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-build}
cd "$repo"
nice make --no-print-directory -s BUILD="$BUILD" "$BUILD/libpdserve.a"
# compile with the project's own flags (the Makefile's CFLAGS / LDLIBS), without a Makefile edit
printf '%s\n' "$BUILD/mask_cost: bench/mask_cost.c $BUILD/libpdserve.a" \
  '	$(CC) $(CFLAGS) -o $@ bench/mask_cost.c $(BUILD)/libpdserve.a $(LDLIBS)' |
  nice make --no-print-directory -s -f Makefile -f - BUILD="$BUILD" "$BUILD/mask_cost"
tokdir=""
case "${1:-}" in
  ""|--*) ;;
  *) tokdir=$1; shift ;;
esac
if [ -z "$tokdir" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm install --no-save --no-audit --no-fund --silent llama3-tokenizer-js@1.2.0 >/dev/null)
  mkdir -p "$tmp/llama3"
  cp bench/llama3_vocab.mjs "$tmp/"  # run beside its node_modules
  node "$tmp/llama3_vocab.mjs" "$repo/models/kjv-llama-6m/tokenizer.json" "$tmp/llama3/tokenizer.json"
  printf '{"bos_token":"<|begin_of_text|>","eos_token":"<|eot_id|>","tokenizer_class":"PreTrainedTokenizerFast"}\n' \
    >"$tmp/llama3/tokenizer_config.json"
  tokdir=$tmp/llama3
fi
echo "mask_cost: $(git rev-parse --short HEAD), $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), load $(cut -d' ' -f1-3 /proc/loadavg)"
"$BUILD/mask_cost" "$tokdir" "$@"
