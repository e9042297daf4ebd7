#!/bin/sh
# Stages the ucx-on-one-GPU run (tools/gpu/run_ucx_device.sh) into DEST (default
# /work/main/build/gpu-ucxgpu, an ignored folder of the checkout the device tool copies): pdserve
# from tools/gpu/build.sh, the device image's missing libraries (DEVLIBS) with Debian's UCX
# libraries replaced by the CUDA-enabled UCX 1.13.1 of tools/gpu/ucx_cuda.sh (lib/*.so.0, modules in
# lib/ucx, ucx_info / ucx_perftest), libcudart.so.13 (the CUDA modules link it; pdserve itself
# links cudart statically), kjv-llama-6m with its golden prompts, and this branch's
# test_disagg_gpu.sh and run script.
#   usage: sh tools/gpu/stage_ucx.sh      env: DEST, DEVLIBS (/work/devlibs/lib), CUDA (/usr/local/cuda)
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-/work/main/build/gpu-ucxgpu}
DEVLIBS=${DEVLIBS:-/work/devlibs/lib}
CUDA=${CUDA:-/usr/local/cuda}
U=$repo/build/ucx-cuda
[ -x "$repo/build/gpu/bin/pdserve" ] || { echo "stage_ucx: run tools/gpu/build.sh first" >&2; exit 1; }
[ -e "$U/lib/ucx/libuct_cuda.so.0" ] || { echo "stage_ucx: run tools/gpu/ucx_cuda.sh first" >&2; exit 1; }
rm -rf "$DEST" && mkdir -p "$DEST/bin" "$DEST/models" "$DEST/tools/gpu"
cp -r "$DEVLIBS" "$DEST/lib"
cp "$CUDA/lib64/libcudart.so.13" "$DEST/lib/"
rm -rf "$DEST/lib/ucx-modules"  # Debian's modules (ib, rdmacm, cma): its libuct's list; ours is cuda, cma
cp -r "$U"/lib/* "$DEST/lib/"
cp "$repo/build/gpu/bin/pdserve" "$U/bin/ucx_info" "$U/bin/ucx_perftest" "$DEST/bin/"
cp -r "$repo/../shared/models/kjv-llama-6m" "$DEST/models/"
mkdir -p "$DEST/models/golden" && cp "$repo/../shared/models/golden/kjv-llama-6m.json" "$DEST/models/golden/"
cp "$repo/tools/gpu/test_disagg_gpu.sh" "$DEST/tools/gpu/"
cp "$repo/tools/gpu/${RUN_SCRIPT:-run_ucx_device.sh}" "$DEST/run.sh"
miss=$(LD_LIBRARY_PATH=$DEST/lib ldd "$DEST/bin/pdserve" "$DEST/bin/ucx_info" "$DEST"/lib/ucx/lib*cuda.so.0 |
  grep "not found" | grep -v -e libcuda.so.1 -e libnvidia-ml.so.1 | sort -u || true)
[ -z "$miss" ] || { echo "stage_ucx: missing libraries: $miss" >&2; exit 1; }
du -sh "$DEST"
