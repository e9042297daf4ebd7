#!/bin/sh
# One device-tool call for the ucx connector's tag (two-sided) path on one GPU (issue 16): two
# processes on device 0. Stage with tools/gpu/stage_ucx.sh (DEST=/work/main/build/gpu-ucxtag; it
# copies this script as run.sh), carry build/gpu-ucxtag, then
#   sh build/gpu-ucxtag/run.sh [STEPS]      (default "ident bench")
# ident — tools/gpu/test_disagg_gpu.sh with ucx, prefill and decode on cuda:0 (outputs identical to
# colocated with 0 fallbacks, one-sequence and batched; corrupted transfers caught);
# identg — the same with PD_UCX_FORCE_GATHER=1 (every save sent from the staging gather);
# bench — pdserve bench-handoff, Llama-3-8B shape, devices 0,0: ucx (tcp for UCX's active
# messages), ucx-sm (sm with UCX_POSIX/SYSV_ERROR_HANDLING=y instead of tcp), then cuda-ipc.
# UCX_TLS=cuda_ipc,cuda_copy,tcp,self: tcp carries UCX's active messages (wire-up, rendezvous
# control) with peer error handling, cuda_ipc the data (src/kvconn/ucx.c says why not sm alone).
G=${G:-build/gpu-ucxtag}
O=/tmp/ucxrun
OUT_DIR=${OUT:-out}
STEPS=${1:-ident identg bench}
mkdir -p "$OUT_DIR" "$O" /tmp/pdit
pack() { tar czf "$OUT_DIR/logs.tgz" -C /tmp ucxrun pdit 2>/dev/null; }
export LD_LIBRARY_PATH=$PWD/$G/lib:/usr/local/nvidia/lib64:/usr/local/nvidia/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_TLS=${UCX_TLS:-cuda_ipc,cuda_copy,tcp,self}
export UCX_WARN_UNUSED_ENV_VARS=n
nvidia-smi -L
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
cp $G/tools/gpu/test_disagg_gpu.sh tools/gpu/test_disagg_gpu.sh  # this branch's version
for step in ident identg; do
  has $step || continue
  fg=0; [ $step = identg ] && fg=1
  PD_UCX_FORCE_GATHER=$fg TMPDIR=/tmp/pdit PD_KEEP_TMP=1 PD_BIN=$PWD/$G/bin/pdserve PD_MODELS_DIR=$PWD/$G/models \
    PD_DEV_PREFILL=cuda:0 PD_DEV_DECODE=cuda:0 PD_GPU_TRANSPORTS=ucx PD_GPU_MODELS=kjv-llama-6m \
    timeout "${IDENT_S:-60}" sh tools/gpu/test_disagg_gpu.sh >"$O/$step.log" 2>&1
  echo "$step (PD_UCX_FORCE_GATHER=$fg) rc=$?" >>"$O/$step.log"
  grep -E "PASS|FAIL|INFO|rc=|warn|error|ucx" "$O/$step.log" | head -30
  grep -h "staging copy" /tmp/pdit/*/pf.err 2>/dev/null | tail -1
  pack
done
if has bench; then
  for tr in ${BENCH_TRANSPORTS:-ucx ucx-sm cuda-ipc}; do
    case $tr in
      ucx-sm) tl=ucx; env="UCX_TLS=cuda_ipc,cuda_copy,sm,self UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y" ;;
      *) tl=$tr; env="" ;;
    esac
    env $env timeout "${BENCH_S:-25}" $G/bin/pdserve bench-handoff --model bench/configs/llama-3-8b --load-format dummy \
      --tokenizer $G/models/kjv-llama-6m --tokens 512,2048 --ttft-tokens 8192 --devices 0,0 --reps "${REPS:-3}" \
      --transport "$tl" --kv-cache-gib 8 --json "$O/handoff_$tr.json" >"$O/handoff_$tr.log" 2>&1
    echo "bench-handoff $tr ($env) rc=$?"
    grep -v '^pdserve info' "$O/handoff_$tr.log" | tail -12
    pack
  done
fi
