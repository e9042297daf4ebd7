#!/bin/sh
# tools/deps.sh — `make deps`: installs, on Debian 12 (bookworm) and its derivatives, every package
# that building pdserve and running any of its tests needs, and only what is missing.
#
# Packages are checked by name (dpkg-query), never by a file they happen to ship: a reference-BLAS
# cblas.h (libblas-dev) once passed for OpenBLAS and the link then failed. A package counts as
# present when it is installed or when an installed package Provides it (nodesource's nodejs
# provides npm and conflicts with Debian's). Libraries that ship a pkg-config file are checked with
# `pkg-config --exists` as well, since that is what the Makefile asks for their flags.
# apt-get runs (update + install) only when something is missing. After the packages, the npm
# clients of tests/integration/js are installed from the lockfile (npm ci) when they are absent or
# older than the lockfile. No test installs anything: tests that miss a tool fail and name it.
#
#   sh tools/deps.sh            check and install
#   sh tools/deps.sh --check    check only: list what is missing, exit 1 if anything is
set -e
repo=$(cd "$(dirname "$0")/.." && pwd)

# Package list: keep one per line with the reason, and add new ones here (never in a test).
PKGS="
build-essential      C compiler, make
pkg-config           compile/link flags of every library below
curl                 integration tests, make run
ca-certificates      HTTPS for npm ci (the registry)
libjansson-dev       JSON
libpcre2-dev         tokenizer pre-tokenization regexes
libevent-dev         HTTP server/client
libxxhash-dev        block hashes, KV checksums
libopenblas-dev      CPU GEMMs (cblas_sgemm, openblas_set_num_threads)
libutf8proc-dev      Unicode normalisation
liburing-dev         io_uring
libhiredis-dev       redis client
redis-server         redis tests
libucx-dev           UCX transport
autoconf             tools/gpu/ucx_cuda.sh (UCX's CUDA modules from Debian's ucx source: autogen.sh)
automake             tools/gpu/ucx_cuda.sh
libtool              tools/gpu/ucx_cuda.sh
libnuma-dev          tools/gpu/ucx_cuda.sh (libucs with numa, as Debian's)
libnats-dev          NATS client
nats-server          NATS tests
libssl-dev           libcrypto (HMAC, auth)
python3              test helpers (fake workers, golden checks)
python3-yaml         tools/check_k8s.py (offline check of deploy/k8s)
nodejs               JS test clients
npm                  installs the openai npm client (npm ci)
chromium             headless render of the router's /status page
fonts-liberation     fonts for headless chromium
clang                libFuzzer targets
libclang-rt-14-dev   clang sanitizer/fuzzer runtimes
"
# pkg-config modules that must resolve once the packages are in (the Makefile reads their flags).
PCS="jansson libpcre2-8 libevent libevent_pthreads libxxhash openblas libutf8proc libcrypto liburing hiredis ucx"

check_only=0
[ "${1:-}" = "--check" ] && check_only=1

# Installed packages and what they provide, one name per line.
have=$(dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Provides}\n' 2>/dev/null |
  awk '$1 ~ /^.i/ { print $2; for (i = 3; i <= NF; i++) { p = $i; sub(/,$/, "", p); if (p !~ /^\(/ && p !~ /\)$/ && p !~ /^[<>=]/) print p } }' |
  sed 's/:.*//' | sort -u)

need=""
for p in $(echo "$PKGS" | awk 'NF { print $1 }'); do
  echo "$have" | grep -qx "$p" || need="$need $p"
done
# kubectl (test_k8s.sh: `kubectl kustomize deploy/k8s`): Debian 12's kubernetes-client (1.20) only when
# no kubectl command exists at all (a newer one from elsewhere is kept, never shadowed).
command -v kubectl >/dev/null 2>&1 || need="$need kubernetes-client"

npm_stale() {
  js="$repo/tests/integration/js"
  [ -f "$js/package-lock.json" ] || return 1
  [ -f "$js/node_modules/.package-lock.json" ] || return 0
  [ "$js/package-lock.json" -nt "$js/node_modules/.package-lock.json" ]
}

if [ "$check_only" = 1 ]; then
  st=0
  [ -z "$need" ] || { echo "deps: missing packages:$need"; st=1; }
  for m in $PCS; do pkg-config --exists "$m" 2>/dev/null || { echo "deps: pkg-config module missing: $m"; st=1; }; done
  npm_stale && { echo "deps: npm clients of tests/integration/js not installed (npm ci)"; st=1; }
  [ $st = 0 ] && echo "deps: all present"
  exit $st
fi

if [ -n "$need" ]; then
  echo "deps: installing$need"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # --no-install-recommends: the list above is complete; recommends pull in ~1 GB of desktop.
  $SUDO apt-get install -y -qq --no-install-recommends $need >/dev/null
fi

for m in $PCS; do
  pkg-config --exists "$m" || { echo "deps: pkg-config cannot find '$m' although its package is installed" >&2; exit 1; }
done

if npm_stale; then
  echo "deps: npm ci in tests/integration/js (from package-lock.json)"
  (cd "$repo/tests/integration/js" && npm ci --no-audit --no-fund --loglevel=error)
fi
