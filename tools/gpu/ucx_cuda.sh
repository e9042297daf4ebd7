#!/bin/sh
# tools/gpu/ucx_cuda.sh — UCX's CUDA transport modules (cuda_copy, cuda_ipc; libuct_cuda.so.0 and
# the memory hooks libucm_cuda.so.0) for Debian's libucx0 1.13.1, which is built without CUDA.
# Production hosts install a CUDA-enabled UCX instead (NVIDIA's HPC-X or DOCA `ucx-cuda` packages,
# conda-forge's ucx); this script exists because the build machine and the device image here have
# only Debian's UCX (the device image: none; the lead's /work/devlibs/lib carries Debian's libs).
#
# Inputs (nothing else is downloaded, no random tarball):
#   * Debian's own source package ucx 1.13.1-1 (apt-get source through a private apt config with a
#     deb-src line for bookworm main; the .dsc's signature and checksums are checked by dpkg-source),
#   * nvml.h from Debian's libnvidia-ml-dev (bookworm non-free; UCX's configure needs NVML for
#     --with-cuda: cuda_ipc asks NVML for NVLink peers) and libnvidia-ml.so from libnvidia-ml1 for
#     the link only (at run time the driver's libnvidia-ml.so.1 is used) — both only unpacked
#     (dpkg -x) into the work folder, never installed,
#   * the CUDA toolkit at $CUDA (default /usr/local/cuda: CUDA 13, nvcc 13.0 here),
#   * autoconf, automake, libtool (Debian's orig tarball has no configure; tools/deps.sh installs them).
# Configure: the flags of debian/rules (--enable-mt --disable-logging --disable-backtrace-detail
# --enable-devel-headers --enable-cma, prefix /usr, Debian's multiarch libdir) plus --with-cuda, so
# the modules match the libucs/libuct/libucm ABI of libucx0 1.13.1-1 (internal structs depend on
# --enable-mt and the logging level). No patch was needed for CUDA 13: 1.13.1's cuda modules use no
# API that CUDA 13 removed (UCX builds with -Wno-deprecated-declarations); the script checks that
# every ucs_/uct_/ucm_ symbol the modules need is exported by the system's Debian libraries.
# Outputs ($OUT_DIR, default build/ucx-cuda): modules/ (libuct_cuda.so.0, libucm_cuda.so.0 and
# libucx_perftest_cuda.so.0 with their .so links: point UCX_MODULE_DIR there, or copy them next to
# Debian's modules in /usr/lib/x86_64-linux-gnu/ucx) and bin/ (ucx_info, ucx_perftest of the same
# source, run against Debian's libs). Rerunnable: a finished step is skipped.
#   usage: sh tools/gpu/ucx_cuda.sh            env: CUDA, OUT_DIR, WORK (default /tmp/ucx-cuda-build)
# Then, e.g.: UCX_MODULE_DIR=$OUT_DIR/modules UCX_TLS=cuda_ipc,cuda_copy,sm,self ucx_info -d
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
CUDA=${CUDA:-/usr/local/cuda}
OUT_DIR=${OUT_DIR:-$repo/build/ucx-cuda}
WORK=${WORK:-/tmp/ucx-cuda-build}
VER=1.13.1-1
ML=/usr/lib/x86_64-linux-gnu
die() { echo "ucx_cuda: $*" >&2; exit 1; }

for t in autoreconf automake libtoolize dpkg-source apt-get make gcc; do
  command -v $t >/dev/null || die "$t is missing (make deps installs autoconf, automake, libtool)"
done
[ -e "$CUDA/include/cuda.h" ] || die "no CUDA toolkit at $CUDA (CUDA=...)"
have=$(dpkg-query -W -f='${Version}' libucx0 2>/dev/null || true)
[ "$have" = "$VER" ] || die "Debian's libucx0 is '$have', this builds modules for $VER only"
mkdir -p "$WORK/apt/lists/partial" "$WORK/dl"

# 1. Sources: Debian's ucx (deb-src) and the NVML header/link library (non-free), private apt state.
cat >"$WORK/apt/sources.list" <<EOF
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm non-free
EOF
APT="-oDir::Etc::SourceList=$WORK/apt/sources.list -oDir::Etc::SourceParts=/dev/null -oDir::State::Lists=$WORK/apt/lists
  -oDir::State::Status=/var/lib/dpkg/status -oAPT::Sandbox::User=root"
if [ ! -d "$WORK/ucx" ]; then
  apt-get $APT update -q
  (cd "$WORK/dl" && apt-get $APT source --download-only "ucx=$VER" && apt-get $APT download libnvidia-ml-dev libnvidia-ml1)
  dpkg-source -x "$WORK/dl/ucx_$VER.dsc" "$WORK/ucx.tmp"  # verifies the .dsc's checksums; applies debian/patches
  rm -rf "$WORK/nvml" && mkdir -p "$WORK/nvml"
  for f in "$WORK"/dl/libnvidia-ml*.deb; do dpkg -x "$f" "$WORK/nvml"; done
  mv "$WORK/ucx.tmp" "$WORK/ucx"
fi
NV=$WORK/nvml/usr
[ -e "$NV/include/nvml.h" ] || die "nvml.h missing in $NV (libnvidia-ml-dev)"

# 2. configure (debian/rules' flags + CUDA), then only what the modules and the two tools need.
if [ ! -e "$WORK/build/config.status" ]; then
  (cd "$WORK/ucx" && [ -e configure ] || ./autogen.sh)
  mkdir -p "$WORK/build"
  (cd "$WORK/build" && "$WORK/ucx/configure" --prefix=/usr --libdir=$ML --enable-mt --disable-backtrace-detail \
     --disable-logging --enable-devel-headers --enable-cma --with-cuda="$CUDA" --without-gdrcopy --without-verbs \
     --without-rocm --without-java --without-go \
     CPPFLAGS="-I$NV/include" LDFLAGS="-L$NV/lib/x86_64-linux-gnu/nvidia/current" >configure.out)
fi
B=$WORK/build
make -C $B/src/ucm libucm.la
for d in src/ucs src/ucm src/uct src/ucp src/tools/info src/tools/perf; do make -j2 -C $B/$d; done
grep -q '^#define HAVE_CUDA 1' $B/config.h || die "configure did not enable CUDA (see $B/configure.out)"

# 3. Install into OUT_DIR, check the modules link against Debian's libraries' exports.
mkdir -p "$OUT_DIR/modules" "$OUT_DIR/bin"
for m in uct/cuda/.libs/libuct_cuda ucm/cuda/.libs/libucm_cuda tools/perf/cuda/.libs/libucx_perftest_cuda; do
  n=$(basename $m)
  cp -L $B/src/$m.so.0 "$OUT_DIR/modules/$n.so.0"
  ln -sf $n.so.0 "$OUT_DIR/modules/$n.so"
done
cp $B/src/tools/info/.libs/ucx_info $B/src/tools/perf/.libs/ucx_perftest "$OUT_DIR/bin/"
strip -g "$OUT_DIR"/modules/*.so.0 "$OUT_DIR"/bin/*
nm -D --defined-only $ML/libucs.so.0 $ML/libuct.so.0 $ML/libucm.so.0 $ML/libucp.so.0 | awk 'NF == 3 { print $3 }' |
  sort -u >"$WORK/debian-syms"
for f in "$OUT_DIR"/modules/*.so.0 "$OUT_DIR"/bin/*; do
  miss=$(nm -D --undefined-only "$f" | awk '{ print $2 }' | grep -E '^(ucs|uct|ucm|ucp)_' | sort | comm -23 - "$WORK/debian-syms")
  [ -z "$miss" ] || die "$(basename "$f") needs symbols Debian's libucx0 does not export: $miss"
done
echo "ucx_cuda: modules in $OUT_DIR/modules (UCX_MODULE_DIR), tools in $OUT_DIR/bin; NEEDED:"
readelf -d "$OUT_DIR/modules/libuct_cuda.so.0" | awk '/NEEDED/ { printf " %s", $NF } END { print "" }'
