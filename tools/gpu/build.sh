#!/bin/sh
# Builds the CUDA library, the pdserve binary, the GPU tests and the op bench into build/gpu (run
# here, not on the GPU machine: it has no compiler). Then: run tool with carry
# ["build/gpu/tests", "build/gpu/bin", "build/gpu/models"] (see NOTES.md). Binaries are stripped of
# debug info to stay under the carry limit.
set -e
cd "$(dirname "$0")/../.."
make -j2 CUDA=1 BUILD=build/gpu build/gpu/libpdserve.a build/gpu/pdserve build/gpu/tests/ops/test_backend_ops \
  build/gpu/tests/golden/test_gpu_golden build/gpu/tests/golden/test_gpu_spec "$@"
mkdir -p build/gpu/bin
CFL="-std=c11 -D_GNU_SOURCE -O2 -g -Isrc -I/usr/local/cuda/include -fopenmp -pthread"
LIBS="-ljansson -lpcre2-8 -levent -levent_pthreads -lxxhash -lopenblas -lm -lpthread -fopenmp \
  -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart_static -ldl -lrt -lstdc++"
cc $CFL -o build/gpu/bin/op_bench tools/gpu/op_bench.c build/gpu/libpdserve.a $LIBS
cc $CFL -o build/gpu/bin/fa3_probe tools/gpu/fa3_probe.c build/gpu/libpdserve.a $LIBS
# op_bench_diag: the prefill attention kernel with its diagnostics (PD_CUDA_FA3_DIAG=noload|nomath: wrong
# results, timing only; attention_prefill.cu) linked ahead of the library's copy.
/usr/local/cuda/bin/nvcc -O3 -std=c++17 -Isrc --use_fast_math -DPD_FA3_DIAG -gencode arch=compute_90a,code=sm_90a \
  -c src/kernels/attention_prefill.cu -o build/gpu/attention_prefill_diag.o 2>build/gpu/attention_prefill_diag.log ||
  { cat build/gpu/attention_prefill_diag.log >&2; exit 1; }
cat build/gpu/attention_prefill_diag.log >&2
# WERROR=1 (as for the library, Makefile): ptxas reports of serialised wgmma fail the build here too
case " $* " in *" WERROR=1 "*)
  if grep -q 'Performance Loss: wgmma\|warpgroup.wait is injected' build/gpu/attention_prefill_diag.log; then
    echo "attention_prefill.cu (PD_FA3_DIAG): ptxas serialised wgmma instructions; WERROR=1 refuses it" >&2; exit 1
  fi;;
esac
cc $CFL -o build/gpu/bin/op_bench_diag tools/gpu/op_bench.c build/gpu/attention_prefill_diag.o build/gpu/libpdserve.a $LIBS
cp build/gpu/pdserve build/gpu/bin/pdserve
strip -g build/gpu/bin/op_bench build/gpu/bin/op_bench_diag build/gpu/bin/fa3_probe build/gpu/bin/pdserve build/gpu/tests/ops/test_backend_ops build/gpu/tests/golden/test_gpu_golden \
  build/gpu/tests/golden/test_gpu_spec
mkdir -p build/gpu/models
for m in golden kjv-llama-6m kjv-llama-1m tiny-random-llama31 tiny-random-qwen2; do
  [ -e build/gpu/models/$m ] || cp -r ../shared/models/$m build/gpu/models/
done
