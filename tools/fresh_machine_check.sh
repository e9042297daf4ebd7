#!/bin/sh
# tools/fresh_machine_check.sh — the README's quick start on a clean Debian 12 (bookworm) root.
#
# Builds a minimal Debian 12 root with debootstrap (--variant=minbase: no compiler, no make, no
# curl, no CA certificates — stricter than a desktop install), puts libblas-dev in it (the
# reference BLAS, common on real machines: its cblas.h once passed for OpenBLAS), copies the tree
# (git ls-files: tracked + untracked-not-ignored files, as a clone would have) to /src/repo and
# the shared models to /src/shared/models (tests look for ../shared/models beside the repository),
# then, inside a chroot, runs what the README says:
#     apt-get install make         (the README's one prerequisite)
#     make run RUN_ARGS="--exit-after-sample --port 0"    must print an answer and exit 0
#     make test                    the runner's last line must say "0 failed"
# Needs root, debootstrap and Debian's mirror (the one apt uses on this machine). /proc, /sys,
# /dev, /dev/pts and a private /dev/shm are mounted in the root and unmounted on any exit.
#
# Cache (FMC_CACHE, default /var/tmp/pdserve-fmc): base-bookworm.tar.gz holds the pristine
# debootstrapped root (made on the first run, unpacked on later ones), apt-archives/ the .deb files
# apt downloaded (bind-mounted into the root: reruns do not download again; apt still decides
# everything). FMC_NO_CACHE=1 starts from scratch. FMC_KEEP=1 keeps the root afterwards.
# Usage: sudo sh tools/fresh_machine_check.sh          (log: stdout; exit 0 = passed)
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
suite=bookworm
cache="${FMC_CACHE:-/var/tmp/pdserve-fmc}"
# The mirror apt uses here (deb822 URIs: or a one-line deb entry), Debian's CDN otherwise.
mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
  awk '/^URIs:.*debian\/?$/ { print $2; exit } /^deb .*debian\/? bookworm/ { print $2; exit }')
mirror="${FMC_MIRROR:-${mirror:-http://deb.debian.org/debian}}"
models="${PD_MODELS_DIR:-$repo/../shared/models}"

[ "$(id -u)" = 0 ] || { echo "fresh_machine_check: needs root (debootstrap, chroot, mount)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "fresh_machine_check: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
[ -d "$models/kjv-llama-6m" ] || { echo "fresh_machine_check: no models at $models" >&2; exit 1; }

mkdir -p "$cache/apt-archives/partial"
root=$(mktemp -d "$cache/root.XXXXXX")
t_start=$(date +%s)
phase() { echo "[fmc $(( $(date +%s) - t_start ))s] $*"; }

cleanup() {
  rc=$?
  set +e
  # Processes still running inside the root (a server left behind) hold the mounts: end them.
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && kill -9 "${p#/proc/}" 2>/dev/null
  done
  for m in var/cache/apt/archives dev/shm dev/pts dev sys proc; do
    mountpoint -q "$root/$m" 2>/dev/null && { umount "$root/$m" 2>/dev/null || umount -l "$root/$m"; }
  done
  if [ -z "${FMC_KEEP:-}" ]; then
    # only remove the root once nothing is mounted below it
    if ! grep -q " $root/" /proc/mounts; then rm -rf "$root"; else echo "fmc: mounts remain under $root; not removed" >&2; fi
  else
    echo "fmc: root kept at $root"
  fi
  phase "finished, exit $rc"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# ---- 1. a clean Debian 12 root -------------------------------------------------------------------
base="$cache/base-$suite.tar.gz"
[ -n "${FMC_NO_CACHE:-}" ] && rm -f "$base"
if [ -f "$base" ]; then
  phase "unpacking the cached base root ($base)"
  tar -xzf "$base" -C "$root"
else
  phase "debootstrap --variant=minbase $suite from $mirror"
  debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 ||
    { tail -30 "$cache/debootstrap.log"; exit 1; }
  # the base stays pristine: sources.list is written below, every run
  tar -czf "$base.tmp" -C "$root" . && mv "$base.tmp" "$base"
fi
cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb ${mirror%/debian*}/debian-security $suite-security main
EOF
cp /etc/resolv.conf "$root/etc/resolv.conf"
# This network's own TLS trust (a proxy's CA in /usr/local/share/ca-certificates, public
# certificates only): a machine on this network has it too, or npm ci cannot reach the registry.
# update-ca-certificates picks it up when make deps installs ca-certificates.
mkdir -p "$root/usr/local/share/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true

mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys"
mount --bind /dev "$root/dev"
mount -t devpts -o newinstance,ptmxmode=0666 devpts "$root/dev/pts" 2>/dev/null || mount --bind /dev/pts "$root/dev/pts"
mount -t tmpfs -o mode=1777,size=4g shm "$root/dev/shm"   # private: what is left in it is ours
if [ -z "${FMC_NO_CACHE:-}" ]; then
  mkdir -p "$root/var/cache/apt/archives"
  mount --bind "$cache/apt-archives" "$root/var/cache/apt/archives"
  chroot "$root" chown _apt:root /var/cache/apt/archives/partial
fi

# ---- 2. the tree, as a clone has it --------------------------------------------------------------
phase "copying the tree ($(cd "$repo" && git ls-files -co --exclude-standard | wc -l) files) and the models"
mkdir -p "$root/src/repo" "$root/src/shared"
(cd "$repo" && git ls-files -co --exclude-standard -z | tar --null --no-recursion -T - -cf -) | tar -xf - -C "$root/src/repo"
cp -a "$models" "$root/src/shared/models"

in_root() { chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  LANG=C.UTF-8 TERM=dumb /bin/sh -c "$1"; }

# ---- 3. a real machine's trap: the reference BLAS, whose cblas.h is not OpenBLAS's ----------------
phase "installing libblas-dev (reference BLAS) as many machines have it"
in_root 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libblas-dev >/dev/null'
# the old file test ("any cblas.h means OpenBLAS") would pass here although OpenBLAS is absent
in_root 'echo "  cblas.h -> $(readlink -f /usr/include/x86_64-linux-gnu/cblas.h); libopenblas-dev: $(dpkg-query -W -f="\${db:Status-Abbrev}" libopenblas-dev 2>/dev/null || echo not installed)"'

# ---- 4. the README -----------------------------------------------------------------------------------
phase "README prerequisite: apt-get install make"
in_root 'DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends make >/dev/null'

phase "make run RUN_ARGS=\"--exit-after-sample --port 0\""
t0=$(date +%s)
in_root 'cd /src/repo && timeout 3600 make run RUN_ARGS="--exit-after-sample --port 0"' >"$cache/make-run.log" 2>&1 ||
  { tail -40 "$cache/make-run.log"; echo "FAIL: make run"; exit 1; }
tail -25 "$cache/make-run.log"
grep -q '^answer: ..' "$cache/make-run.log" || { echo "FAIL: make run printed no answer"; exit 1; }
phase "make run: ok ($(( $(date +%s) - t0 ))s, packages and build included)"

phase "make test"
t0=$(date +%s)
in_root 'cd /src/repo && timeout 5400 make test' >"$cache/make-test.log" 2>&1 || true
tail -15 "$cache/make-test.log"
last=$(grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' "$cache/make-test.log" | tail -1)
phase "make test: '$last' ($(( $(date +%s) - t0 ))s)"
left=$(ls -A "$root/dev/shm" | head -20)
[ -z "$left" ] || echo "note: files left in the root's /dev/shm: $left"
echo "$last" | grep -Eq '^[0-9]+ passed, 0 failed, [0-9]+ skipped$' || { grep '^-- .*FAILED' "$cache/make-test.log"; echo "FAIL: make test: ${last:-no runner line}"; exit 1; }
phase "PASS: make run and make test on a clean Debian 12 root (total $(( $(date +%s) - t_start ))s)"
