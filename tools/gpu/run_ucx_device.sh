#!/bin/sh
# One device-tool call for the ucx connector on one GPU (issue 16): two processes on device 0.
# Stage here with tools/gpu/stage_ucx.sh (binaries, the CUDA-enabled UCX 1.13.1 of
# tools/gpu/ucx_cuda.sh, models) into build/gpu-ucxgpu of the lead's checkout, carry it, then
#   sh build/gpu-ucxgpu/run.sh "$OUT" [STEPS]
# Steps (default "info perf copy ident bench"): info — ucx_info lists cuda_copy / cuda_ipc;
# perf — ucx_perftest ucp_put_bw device → device between two processes (UCX's own rate);
# copy — the device's own copy rate (torch, D2D, same process); ident — tools/gpu/test_disagg_gpu.sh
# with ucx, prefill and decode on cuda:0 (outputs identical to colocated, corrupted slabs caught);
# bench — pdserve bench-handoff, Llama-3-8B shape, ucx then cuda-ipc, devices 0,0;
# perfinfo — ucx_perftest put device → device with UCX_LOG_LEVEL=info (the lanes UCP picked), old
# and new protocols (UCX_PROTO_ENABLE=n/y); refuse — bench-handoff ucx as shipped (the decode worker
# must refuse its device pool with a clear error); optin — the same with PD_UCX_DEVICE_RMA=1 and
# UCX_LOG_LEVEL=info, one 512-token handoff (what UCX 1.13 really does with the puts).
G=${G:-build/gpu-ucxgpu}
OUT_DIR=${1:-${OUT:-out}}
STEPS=${2:-info perf copy ident bench}
O=/tmp/ucxrun  # logs; after each step they are packed into OUT_DIR/logs.tgz (the tool returns 8 files at most)
mkdir -p "$OUT_DIR" "$O" /tmp/pdit
pack() { tar czf "$OUT_DIR/logs.tgz" -C /tmp ucxrun pdit 2>/dev/null; }
export LD_LIBRARY_PATH=$PWD/$G/lib:/usr/local/nvidia/lib64:/usr/local/nvidia/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_TLS=${UCX_TLS:-cuda_ipc,cuda_copy,sm,self}  # (the modules: lib/ucx beside libucs.so.0)
export UCX_WARN_UNUSED_ENV_VARS=n
nvidia-smi -L
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
if has info; then
  $G/bin/ucx_info -v | head -3
  ldd $G/lib/ucx/libuct_cuda.so.0 | grep -E "not found|nvidia-ml|libcuda"
  UCX_LOG_LEVEL=debug timeout 20 $G/bin/ucx_info -d >"$O/ucx_info.log" 2>&1
  echo "ucx_info rc=$?"; grep -E "Transport:|Memory domain:|memory types|dlopen|cuda" "$O/ucx_info.log" | sort | uniq -c | head -24
  pack
fi
if has perf; then
  for sz in 67108864 1073741824; do
    timeout 15 $G/bin/ucx_perftest -t ucp_put_bw -m cuda,cuda -s $sz -n 10 -w 2 -p 13377 >"$O/perf_srv_$sz.log" 2>&1 &
    sleep 1
    timeout 12 $G/bin/ucx_perftest 127.0.0.1 -t ucp_put_bw -m cuda,cuda -s $sz -n 10 -w 2 -p 13377 >"$O/perf_$sz.log" 2>&1
    echo "ucx_perftest put_bw cuda->cuda $sz B rc=$?"; tail -3 "$O/perf_$sz.log"
    wait
  done
  pack
fi
if has copy; then
  timeout 25 python3 - <<'PY' 2>&1 | tee "$O/copy.log"
import torch, time
for mb in (64, 256, 1024):
    n = mb << 20
    a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
    for _ in range(3): b.copy_(a)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): b.copy_(a)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 20
    print("device copy %5d MiB: %.3f ms, %.0f GB/s (bytes copied; x2 read+write)" % (mb, dt * 1e3, n / dt / 1e9))
PY
  pack
fi
if has ident; then
  cp $G/tools/gpu/test_disagg_gpu.sh tools/gpu/test_disagg_gpu.sh  # this branch's version (ucx corrupt mode)
  TMPDIR=/tmp/pdit PD_KEEP_TMP=1 PD_BIN=$PWD/$G/bin/pdserve PD_MODELS_DIR=$PWD/$G/models PD_DEV_PREFILL=cuda:0 \
    PD_DEV_DECODE=cuda:0 PD_GPU_TRANSPORTS=ucx PD_GPU_MODELS=kjv-llama-6m \
    timeout "${IDENT_S:-60}" sh tools/gpu/test_disagg_gpu.sh >"$O/identical.log" 2>&1
  echo "identical rc=$?" >>"$O/identical.log"
  grep -E "PASS|FAIL|INFO|rc=|warn|error|ucx" "$O/identical.log" | head -40
  pack
fi
if has bench; then
  for tr in ${BENCH_TRANSPORTS:-ucx cuda-ipc}; do
    timeout "${BENCH_S:-35}" $G/bin/pdserve bench-handoff --model bench/configs/llama-3-8b --load-format dummy \
      --tokenizer $G/models/kjv-llama-6m --tokens 512,2048 --ttft-tokens 8192 --devices 0,0 --reps "${REPS:-5}" \
      --transport "$tr" --kv-cache-gib 8 --json "$O/handoff_$tr.json" >"$O/handoff_$tr.log" 2>&1
    echo "bench-handoff $tr rc=$?"
    grep -v '^pdserve info' "$O/handoff_$tr.log" | tail -12
    pack
  done
fi
if has perfinfo; then
  for pe in n y; do
    UCX_PROTO_ENABLE=$pe UCX_LOG_LEVEL=info timeout 12 $G/bin/ucx_perftest -t ucp_put_bw -m cuda,cuda -s 67108864 -n 5 \
      -p 13378 >"$O/perfinfo_srv_$pe.log" 2>&1 &
    sleep 1
    UCX_PROTO_ENABLE=$pe UCX_LOG_LEVEL=info timeout 10 $G/bin/ucx_perftest 127.0.0.1 -t ucp_put_bw -m cuda,cuda \
      -s 67108864 -n 5 -p 13378 >"$O/perfinfo_$pe.log" 2>&1
    echo "ucx_perftest UCX_PROTO_ENABLE=$pe rc=$?"
    grep -E "ep_cfg|rma|Segmentation|backtrace|ERROR|bcopy|zcopy|MB/s|^ *[0-9]" "$O/perfinfo_$pe.log" | head -12
    wait
  done
  pack
fi
if has refuse; then
  timeout 30 $G/bin/pdserve bench-handoff --model bench/configs/llama-3-8b --load-format dummy \
    --tokenizer $G/models/kjv-llama-6m --tokens 512 --ttft-tokens 512 --devices 0,0 --reps 1 --transport ucx \
    --kv-cache-gib 8 >"$O/refuse.log" 2>&1
  echo "bench-handoff ucx (as shipped) rc=$?"; grep -v '^pdserve info' "$O/refuse.log" | tail -4
  pack
fi
if has optin; then
  PD_UCX_DEVICE_RMA=1 UCX_LOG_LEVEL=info timeout 40 $G/bin/pdserve bench-handoff --model bench/configs/llama-3-8b \
    --load-format dummy --tokenizer $G/models/kjv-llama-6m --tokens 512 --ttft-tokens 512 --devices 0,0 --reps 1 \
    --transport ucx --kv-cache-gib 8 >"$O/optin.log" 2>&1
  echo "bench-handoff ucx PD_UCX_DEVICE_RMA=1 rc=$?"
  grep -E "ep_cfg|Segmentation|signal|backtrace| [0-9]+  .*lib|fell back|fallback|KV copy|TTFT|ucx" "$O/optin.log" | head -30
  pack
fi
