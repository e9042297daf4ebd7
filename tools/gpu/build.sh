#!/bin/sh
# Builds the CUDA library, the ops test and the op bench into build/gpu (run here, not on the
# GPU machine: it has no compiler). Then: run tool with carry ["build/gpu/tests", "build/gpu/bin"].
set -e
cd "$(dirname "$0")/../.."
make -j2 CUDA=1 BUILD=build/gpu build/gpu/libpdserve.a build/gpu/tests/ops/test_backend_ops "$@"
mkdir -p build/gpu/bin
CFL="-std=c11 -D_GNU_SOURCE -O2 -g -Isrc -I/usr/local/cuda/include -fopenmp -pthread"
LIBS="-ljansson -lpcre2-8 -levent -levent_pthreads -lxxhash -lopenblas -lm -lpthread -fopenmp \
  -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart_static -ldl -lrt -lstdc++"
cc $CFL -o build/gpu/bin/op_bench tools/gpu/op_bench.c build/gpu/libpdserve.a $LIBS
cc $CFL -o build/gpu/bin/bench_engine tools/gpu/bench_main.c src/cmd/bench_engine.c build/gpu/libpdserve.a $LIBS
