#!/bin/sh
# One device call on two GPUs (issue 13, layer-wise nccl; session 6, helper "nccl"). Run from a
# folder holding bin/{pdserve,test_backend_ops}, lib/ (shared libraries the device image lacks),
# models/ (kjv-llama-6m, tiny-random-qwen2, golden/), bench/configs/llama-3-8b, and this tree's
# tools/gpu/test_disagg_gpu.sh + tests/integration/{lib/server.sh,disagg_client.py}:
#   1. test_backend_ops;
#   2. tools/gpu/test_disagg_gpu.sh, prefill on cuda:0, decode on cuda:1, cuda-ipc and nccl
#      (ucx needs a host pool: not on GPUs);
#   3. pdserve bench-handoff (Llama-3-8B shape, dummy weights) devices 0,1, 512 / 2048 / 8192 tokens,
#      nccl and cuda-ipc, PD_KV_OVERLAP=1 and 0.
# libnccl.so.2 is loaded at run time (src/backend/cuda/nccl.c): it is too large to carry (218 MB),
# so it is looked up on the device (ldconfig, then the Python packages' nvidia/nccl/lib).
# usage: sh run_nccl_x2.sh OUT_DIR
set -u
out=$1; mkdir -p "$out"; out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."  # the folder root
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # never NVLink multicast (shared machines)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -3
nl=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 / {print $NF; exit}')
[ -n "$nl" ] || nl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
[ -n "$nl" ] && [ -e "$nl" ] || nl=$(timeout 30 find / -xdev -name 'libnccl.so.2' 2>/dev/null | head -1)
echo "libnccl: ${nl:-not found}"
L="$PWD/lib"
[ -n "$nl" ] && L="$L:$(dirname "$nl")"
export LD_LIBRARY_PATH="$L${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd bin/pdserve | grep 'not found'
timeout 60 bin/test_backend_ops >"$out/ops.log" 2>&1; echo "test_backend_ops rc=$?: $(tail -1 "$out/ops.log")"
grep FAIL "$out/ops.log" | head -5
mkdir -p /tmp/pdit
TMPDIR=/tmp/pdit PD_BIN=$PWD/bin/pdserve PD_MODELS_DIR=$PWD/models timeout "${IDENT_S:-150}" \
  sh tools/gpu/test_disagg_gpu.sh >"$out/identical.log" 2>&1
echo "test_disagg_gpu rc=$?"
grep -E "PASS|FAIL|INFO|NCCL|warn|error" "$out/identical.log" | cut -c1-220 | head -40
B="--model bench/configs/llama-3-8b --load-format dummy --tokenizer models/kjv-llama-6m"
for tr in nccl cuda-ipc; do
  for ov in 1 0; do
    PD_KV_OVERLAP=$ov timeout "${BENCH_S:-60}" bin/pdserve bench-handoff $B --tokens 512,2048,8192 --ttft-tokens 8192 \
      --devices 0,1 --transport $tr --reps "${REPS:-5}" --kv-cache-gib 8 --json "$out/handoff_${tr}_ov$ov.json" \
      >"$out/handoff_${tr}_ov$ov.txt" 2>&1
    echo "== bench-handoff $tr overlap=$ov rc=$?"
    grep -vE "^\s*$|^pdserve info" "$out/handoff_${tr}_ov$ov.txt" | tail -12 | cut -c1-170
  done
done
