#!/bin/sh
# Stages build/gpu-dec14/ in the lead's checkout from this worktree's build/gpu (dec14 helper).
# Usage: sh tools/gpu/dec14/stage.sh LIMIT
set -e
cd "$(dirname "$0")/../../.."
S=/work/main/build/gpu-dec14
mkdir -p $S
rm -f $S/READY
tmp=$(mktemp -d)
cp build/gpu/bin/pdserve build/gpu/bin/op_bench build/gpu/tests/ops/test_backend_ops build/gpu/tests/golden/test_gpu_golden \
  build/gpu/tests/golden/test_gpu_spec $tmp/
# one xz stream with a 64 MB dictionary: the binaries share the library
tar cf - -C $tmp pdserve op_bench test_backend_ops test_gpu_golden test_gpu_spec | xz -9 -T1 > $S/bins.tar.xz
rm -rf $tmp
cp tools/gpu/dec14/run.sh $S/run.sh
git rev-parse --short HEAD > $S/COMMIT
echo "$1" > $S/LIMIT
du -sh $S
touch $S/READY
ls -la $S
