#!/bin/sh
# tools/gpu/ucx_cuda.sh — a CUDA-enabled UCX 1.13.1 (libucs/libucm/libuct/libucp + the modules
# cuda_copy/cuda_ipc in libuct_cuda, the memory hooks libucm_cuda, cma) built from Debian's own
# source package of the libucx0 this project links (1.13.1-1), which Debian builds without CUDA.
# Production hosts install a CUDA-enabled UCX instead (NVIDIA's HPC-X or DOCA `ucx-cuda` packages,
# conda-forge's ucx); this script exists because the build machine and the device image here have
# only Debian's UCX (the device image: none; the lead's /work/devlibs/lib carries Debian's libs).
#
# Why whole libraries and not only the modules next to Debian's: libuct and libucm load the modules
# of a list compiled in at configure time (Debian's libuct.so.0 holds ":ib:rdmacm:cma", its libucm
# none), never the files found in the module folder, so a libuct_cuda.so.0 beside them is never
# opened (seen on the device, session 7: ucx_info -d listed no cuda transport; UCX_MODULES only
# filters that list). The four libraries here have the same SONAMEs and version, and the script
# checks they export every symbol Debian's do: a binary linked against Debian's libucx0 (pdserve)
# runs unchanged with LD_LIBRARY_PATH=$OUT_DIR/lib (the modules are found in lib/ucx beside libucs).
#
# Inputs (nothing else is downloaded, no random tarball):
#   * Debian's own source package ucx 1.13.1-1 (apt-get source through a private apt config with a
#     deb-src line for bookworm main; dpkg-source checks the .dsc's checksums, applies debian/patches),
#   * nvml.h from Debian's libnvidia-ml-dev (bookworm non-free; UCX's configure needs NVML for
#     --with-cuda: cuda_ipc asks NVML for NVLink peers) and libnvidia-ml.so from libnvidia-ml1 for
#     the link only (at run time the driver's libnvidia-ml.so.1 is used) — both only unpacked
#     (dpkg -x) into the work folder, never installed,
#   * the CUDA toolkit at $CUDA (default /usr/local/cuda: CUDA 13, nvcc 13.0 here),
#   * autoconf, automake, libtool (Debian's orig tarball has no configure) and libnuma-dev
#     (tools/deps.sh installs them).
# Configure: the flags of debian/rules (--enable-mt --disable-logging --disable-backtrace-detail
# --enable-devel-headers --enable-cma, prefix /usr, Debian's multiarch libdir) plus --with-cuda;
# libnuma (as Debian's amd64 build: libucs exports ucs_numa_* only with it; libnuma-dev), no
# verbs/rdmacm (no RDMA here; production RDMA hosts use a vendor UCX). No patch was needed for CUDA 13: 1.13.1's cuda modules use no API that CUDA 13
# removed (UCX builds with -Wno-deprecated-declarations).
# Outputs ($OUT_DIR, default build/ucx-cuda): lib/ (libucs/libucm/libuct/libucp.so.0), lib/ucx/
# (libuct_cuda, libucm_cuda, libuct_cma, libucx_perftest_cuda .so.0) and bin/ (ucx_info,
# ucx_perftest). Rerunnable: a finished step is skipped.
#   usage: sh tools/gpu/ucx_cuda.sh            env: CUDA, OUT_DIR, WORK (default /tmp/ucx-cuda-build)
# Then, e.g.: LD_LIBRARY_PATH=$OUT_DIR/lib UCX_TLS=cuda_ipc,cuda_copy,sm,self $OUT_DIR/bin/ucx_info -d
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
[ -e /usr/include/numa.h ] || die "libnuma-dev is missing (make deps installs it)"
FLAGS="--prefix=/usr --libdir=$ML --enable-mt --disable-backtrace-detail --disable-logging --enable-devel-headers
  --enable-cma --enable-numa --with-cuda=$CUDA --without-gdrcopy --without-verbs --without-rocm --without-java --without-go"
if [ ! -e "$WORK/build/config.status" ] || [ "$(cat "$WORK/build/flags" 2>/dev/null)" != "$FLAGS" ]; then
  (cd "$WORK/ucx" && [ -e configure ] || ./autogen.sh)
  rm -rf "$WORK/build" && mkdir -p "$WORK/build"
  (cd "$WORK/build" && "$WORK/ucx/configure" $FLAGS CPPFLAGS="-I$NV/include" \
     LDFLAGS="-L$NV/lib/x86_64-linux-gnu/nvidia/current" >configure.out)
  echo "$FLAGS" >"$WORK/build/flags"
fi
B=$WORK/build
make -C $B/src/ucm libucm.la
for d in src/ucs src/ucm src/uct src/ucp src/tools/info src/tools/perf; do make -j2 -C $B/$d; done
grep -q '^#define HAVE_CUDA 1' $B/config.h || die "configure did not enable CUDA (see $B/configure.out)"

# 3. Install into OUT_DIR; check ours export every symbol Debian's libraries do.
rm -rf "$OUT_DIR" && mkdir -p "$OUT_DIR/lib/ucx" "$OUT_DIR/bin"
for l in ucs/.libs/libucs ucm/.libs/libucm uct/.libs/libuct ucp/.libs/libucp; do cp -L $B/src/$l.so.0 "$OUT_DIR/lib/"; done
for m in uct/cuda/.libs/libuct_cuda uct/sm/scopy/cma/.libs/libuct_cma ucm/cuda/.libs/libucm_cuda \
         tools/perf/cuda/.libs/libucx_perftest_cuda; do
  cp -L $B/src/$m.so.0 "$OUT_DIR/lib/ucx/"
done
cp $B/src/tools/info/.libs/ucx_info $B/src/tools/perf/.libs/ucx_perftest "$OUT_DIR/bin/"
strip -g "$OUT_DIR"/lib/*.so.0 "$OUT_DIR"/lib/ucx/*.so.0 "$OUT_DIR"/bin/*
syms() { nm -D --defined-only "$@" | awk 'NF == 3 && $2 != "A" { print $3 }' | sort -u; }
syms $ML/libucs.so.0 $ML/libuct.so.0 $ML/libucm.so.0 $ML/libucp.so.0 >"$WORK/debian-syms"
syms "$OUT_DIR"/lib/*.so.0 >"$WORK/our-syms"
miss=$(comm -23 "$WORK/debian-syms" "$WORK/our-syms")
[ -z "$miss" ] || die "these libraries lack symbols Debian's libucx0 exports: $(echo $miss | head -c 600)"
strings "$OUT_DIR/lib/libuct.so.0" | grep -qx ':cuda:cma' || die "libuct's module list lacks cuda"
echo "ucx_cuda: UCX $VER with CUDA in $OUT_DIR/lib (modules in lib/ucx), tools in $OUT_DIR/bin; libuct_cuda NEEDED:"
readelf -d "$OUT_DIR/lib/ucx/libuct_cuda.so.0" | awk '/NEEDED/ { printf " %s", $NF } END { print "" }'
