#!/bin/sh
# Builds tools/gpu/sample_prof.cu (the sampling kernel with phase marks) into build/gpu/bin.
set -e
cd "$(dirname "$0")/../.."
mkdir -p build/gpu/bin
/usr/local/cuda/bin/nvcc -O3 -std=c++17 -Isrc --use_fast_math -gencode arch=compute_90a,code=sm_90a \
  -o build/gpu/bin/sample_prof tools/gpu/sample_prof.cu
