#!/bin/sh
# Fails if an #include crosses the layer rules of docs/design.md. Each module lists the modules
# it may include (besides itself); anything else is a violation.
cd "$(dirname "$0")/.." || exit 1
allowed() {
  case "$1" in
    base) echo "base" ;;
    backend) echo "base backend kernels" ;;
    kernels) echo "kernels" ;;
    kv|tok|wire|net|metrics) echo "base $1" ;;
    kvtier) echo "base kvtier" ;;
    model) echo "base backend tok model" ;;
    grammar) echo "base tok grammar" ;;
    sched) echo "base kv sched" ;;
    spec) echo "base spec" ;;
    xfer) echo "base wire net backend kv xfer" ;;
    kvconn) echo "base wire net backend kv kvtier xfer kvconn" ;;
    http) echo "base net http" ;;
    control) echo "base control" ;;
    engine) echo "base model sched kv kvconn backend metrics tok wire net spec engine" ;;
    api) echo "base http tok engine metrics net grammar api" ;;
    router) echo "base http net wire metrics control router" ;;
    bench) echo "base http net metrics bench" ;;
    cmd) echo "*" ;;
    *) echo "*" ;;
  esac
}
bad=0
for f in $(find src -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh'); do
  mod=$(echo "$f" | cut -d/ -f2)
  ok=$(allowed "$mod")
  [ "$ok" = "*" ] && continue
  for inc in $(grep -hoE '^#include "[a-z_]+/' "$f" | sed -E 's/#include "([a-z_]+)\//\1/'); do
    case " $ok " in *" $inc "*) ;; *) echo "layering: $f includes $inc/ (allowed: $ok)"; bad=1 ;; esac
  done
done
# The engine reaches the KV path through the connector interface only: kvconn/kvconn.h, never a
# transport file, the connector's internals or the session layer (xfer/, excluded above).
if grep -nE '^#include "kvconn/' src/engine/*.c src/engine/*.h | grep -v '"kvconn/kvconn.h"' | grep .; then
  echo "layering: the engine includes a KV transport or connector internals (only kvconn/kvconn.h is allowed)"; bad=1
fi
# libnats belongs to the control plane alone (control/): the router and the serve command reach NATS
# through control/control.h only.
if grep -rln '<nats/\|<nats\.h>' src | grep -v '^src/control/' | grep .; then
  echo "layering: a NATS header included outside src/control/"; bad=1
fi
# PD_USE_CUDA belongs to the backend registry alone.
if grep -rl 'PD_USE_CUDA' src | grep -v 'src/backend/registry.c' | grep -q .; then
  echo "layering: PD_USE_CUDA used outside src/backend/registry.c"; bad=1
fi
[ $bad = 0 ] && echo "check_deps: layering ok"
exit $bad
