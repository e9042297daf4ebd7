#!/bin/sh
# Installs the Debian/Ubuntu packages pdserve builds against, only when one is missing.
# Library -dev packages are checked by header; apt runs only if something is absent.
set -e
need=""
chk() { [ -e "$1" ] || need="$need $2"; }
chk /usr/include/jansson.h libjansson-dev
chk /usr/include/pcre2.h libpcre2-dev
chk /usr/include/event2/event.h libevent-dev
chk /usr/include/xxhash.h libxxhash-dev
chk /usr/include/utf8proc.h libutf8proc-dev
[ -e /usr/include/x86_64-linux-gnu/cblas.h ] || [ -e /usr/include/cblas.h ] || need="$need libopenblas-dev"
command -v cc >/dev/null 2>&1 || need="$need build-essential"
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
command -v curl >/dev/null 2>&1 || need="$need curl"
if [ -n "$need" ]; then
  echo "deps: installing$need"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $need >/dev/null
fi
