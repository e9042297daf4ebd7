#!/bin/sh
# One device call for issue 17 (fp8 KV, bench-engine accounting): tests, then bench-engine old vs
# new (bf16 KV) vs new (fp8 KV) on the same card, then the attention op bench. Run from a folder
# holding pdserve, pdserve-old (the previous commit's build), test_backend_ops, test_gpu_golden,
# op_bench and models/ (golden + small models); bench configs are read from ../bench/configs.
# usage: sh run_issue17.sh OUT_DIR [tests|bench|ops]...  (no section: all)
set -u
out=$1
shift
want() { [ $# -eq 0 ] && return 0; for s in $ALL; do [ "$s" = "$1" ] && return 0; done; return 1; }
ALL="$*"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
export PD_MODELS_DIR=models
# libraries the machine image lacks (libutf8proc since the tokenizer's NFC tables), carried in lib/
[ -d lib ] && export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B="--model ../bench/configs/llama-3-8b --load-format dummy"
if [ -z "$ALL" ] || want tests; then
  ./test_backend_ops > "$out/ops.log" 2>&1; echo "test_backend_ops rc=$?: $(tail -1 "$out/ops.log")"
  grep -E "FAIL|fail" "$out/ops.log" | head -5
  ./test_gpu_golden > "$out/golden.log" 2>&1; echo "test_gpu_golden rc=$?: $(tail -1 "$out/golden.log")"
  grep -E "fp8|FAIL|fail" "$out/golden.log" | head -20
fi
if [ -z "$ALL" ] || want bench; then
  for i in 1 2; do
    ./pdserve-old bench-engine $B --only decode > "$out/old_$i.txt" 2>&1
    ./pdserve bench-engine $B --only decode --ctx 128,4096 --json "$out/new_$i.json" > "$out/new_$i.txt" 2>&1
  done
  ./pdserve bench-engine $B --only single --ctx 8192,32768 > "$out/new_long.txt" 2>&1
  ./pdserve bench-engine $B --only single --ctx 128,4096,8192,32768 --kv-cache-dtype fp8 > "$out/fp8_single.txt" 2>&1
  ./pdserve bench-engine $B --only decode --ctx 1 --batches 1,4,8 --batch-ctx 32768 > "$out/bf16_32k.txt" 2>&1
  ./pdserve bench-engine $B --only decode --ctx 1 --batches 1,4,8,16 --batch-ctx 32768 --kv-cache-dtype fp8 > "$out/fp8_32k.txt" 2>&1
  ./pdserve bench-engine $B --only decode --ctx 1 --batches 1,8,32,64,128,256 --kv-cache-dtype fp8 > "$out/fp8_batch.txt" 2>&1
  ./pdserve-old bench-engine $B --only prefill > "$out/old_prefill.txt" 2>&1
  ./pdserve bench-engine $B --only prefill > "$out/new_prefill.txt" 2>&1
  ./pdserve bench-engine $B --only prefill --kv-cache-dtype fp8 > "$out/fp8_prefill.txt" 2>&1
  for f in old_1 new_1 old_2 new_2 new_long fp8_single bf16_32k fp8_32k fp8_batch old_prefill new_prefill fp8_prefill; do
    echo "== $f"; grep -E "^device|^decode|^prefill|TFLOP/s =|error|fail" "$out/$f.txt" | cut -c1-150
  done
fi
if want fp8bench; then
  ./pdserve bench-engine $B --only single --ctx 128,4096,8192,32768 --kv-cache-dtype fp8 > "$out/fp8_single.txt" 2>&1
  ./pdserve bench-engine $B --only decode --ctx 1 --batches 1,4,8 --batch-ctx 32768 > "$out/bf16_32k.txt" 2>&1
  ./pdserve bench-engine $B --only decode --ctx 1 --batches 1,4,8,16 --batch-ctx 32768 --kv-cache-dtype fp8 > "$out/fp8_32k.txt" 2>&1
  ./pdserve bench-engine $B --only decode --ctx 1 --batches 1,8,32,64,128,256 --kv-cache-dtype fp8 > "$out/fp8_batch.txt" 2>&1
  ./pdserve bench-engine $B --only prefill --kv-cache-dtype fp8 > "$out/fp8_prefill.txt" 2>&1
  for f in fp8_single bf16_32k fp8_32k fp8_batch fp8_prefill; do
    echo "== $f"; grep -E "^decode|^prefill|error|fail" "$out/$f.txt" | cut -c1-150
  done
fi
if want attnab; then  # decode attention knobs, kernel level, one binary
  for e in "PD_CUDA_ATTN_PIPE=0" "V=default" "PD_CUDA_ATTN_WAVES=8" "PD_CUDA_ATTN_WAVES=16" "PD_CUDA_ATTN_PIPE=0 PD_CUDA_ATTN_WAVES=8"; do
    echo "== $e"; env $e ./op_bench attn > "$out/attn_$(echo $e | tr ' =' '__').txt" 2>&1
    grep attn "$out/attn_$(echo $e | tr ' =' '__').txt"
  done
fi
if want waves; then  # fewer, longer partitions for large grids
  for e in "V=default" "PD_CUDA_ATTN_WAVES=1" "PD_CUDA_ATTN_WAVES=2" "PD_CUDA_ATTN_WAVES=2 PD_CUDA_ATTN_PIPE=0"; do
    echo "== $e"; env $e ./op_bench attn 2>&1 | grep "B=64\|B=256\|B=32 "
  done
  for i in 1 2; do
    for e in "V=default" "PD_CUDA_ATTN_WAVES=2" "PD_CUDA_ATTN_WAVES=1"; do
      f="$out/wv_$(echo $e | tr ' =' '__')_$i.txt"
      env $e ./pdserve bench-engine $B --only decode --ctx 1 > "$f" 2>&1
      echo "== $e run $i: $(grep -E '^decode step' "$f" | sed -E 's/^decode (single-stream|step) +(.*[^ ]) +([0-9.]+) ms.*/\2 \3;/' | tr '\n' ' ')"
    done
  done
fi
if want decab; then  # end to end, old binary vs new with the knobs
  for i in 1 2; do
    for e in "OLD" "PD_CUDA_ATTN_PIPE=0" "V=default" "PD_CUDA_ATTN_WAVES=8"; do
      f="$out/dec_$(echo $e | tr ' =' '__')_$i.txt"
      if [ "$e" = OLD ]; then ./pdserve-old bench-engine $B --only decode > "$f" 2>&1
      else env $e ./pdserve bench-engine $B --only decode --ctx 128,4096,8192,32768 > "$f" 2>&1; fi
      echo "== $e run $i: $(grep -E '^decode' "$f" | sed -E 's/^decode (single-stream|step) +(.*[^ ]) +([0-9.]+) ms.*/\2 \3;/' | tr '\n' ' ')"
    done
  done
fi
if want onewave; then  # one-wave split sizing for small grids, kernel level and end to end
  PD_CUDA_ATTN_ONEWAVE=1 ./op_bench attn > "$out/attn_onewave.txt" 2>&1; echo "== ONEWAVE=1"; grep "B=1 \|B=8 " "$out/attn_onewave.txt"
  for i in 1 2; do
    for e in "V=default" "PD_CUDA_ATTN_ONEWAVE=1"; do
      f="$out/ow_$(echo $e | tr ' =' '__')_$i.txt"
      env $e ./pdserve bench-engine $B --only single --ctx 128,4096,8192,32768 > "$f" 2>&1
      echo "== $e run $i: $(grep -E '^decode' "$f" | sed -E 's/^decode (single-stream|step) +(.*[^ ]) +([0-9.]+) ms.*/\2 \3;/' | tr '\n' ' ')"
    done
  done
fi
if [ -z "$ALL" ] || want ops; then
  ./op_bench attn prefill > "$out/op_bench.txt" 2>&1; grep attn "$out/op_bench.txt"
fi
