# server.sh — helpers shared by tests/integration/*.sh (POSIX sh; sourced, not run).
#   pd_need TOOL...          fails, naming it, when a tool is missing (make deps installs them all;
#                            a test never installs anything)
#   pd_setup                 finds PD_BIN and the model, makes $TMP, installs the cleanup trap
#   pd_start NAME FLAGS...   starts `pdserve serve` on a free port (--port 0, read back from its
#                            output), waits for GET /health (polling, 60 s deadline), sets $URL
#   pd_stop NAME             SIGTERM, waits for a clean exit (status 0)
#   pd_redis_start SECRET [FLAGS...]   redis-server on a free port (RPORT), waited for
# Every server started is killed on exit, whatever happens.

pd_fail() { echo "FAIL: $*" >&2; exit 1; }

pd_need() {
  for t in "$@"; do
    command -v "$t" >/dev/null 2>&1 || pd_fail "$t is required and missing (make deps installs it)"
  done
}

pd_setup() {
  # Several servers share a small CI machine: one compute thread each avoids OpenMP spin contention.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  pd_need curl
  repo="${PD_REPO_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"
  PD_BIN="${PD_BIN:-$repo/build/pdserve}"
  [ -x "$PD_BIN" ] || pd_fail "no pdserve binary at $PD_BIN (build with make)"
  MODEL="$repo/models/kjv-llama-6m"
  [ -e "$MODEL/config.json" ] || MODEL="${PD_MODELS_DIR:-$repo/../shared/models}/kjv-llama-6m"
  [ -e "$MODEL/config.json" ] || pd_fail "model kjv-llama-6m not found"
  TMP=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-it.XXXXXX")
  trap 'pd_cleanup' EXIT
  trap 'exit 1' INT TERM
}

pd_cleanup() {
  for f in "$TMP"/*.pid; do
    [ -e "$f" ] || continue
    p=$(cat "$f")
    kill "$p" 2>/dev/null
  done
  for f in "$TMP"/*.pid; do
    [ -e "$f" ] || continue
    p=$(cat "$f")
    i=0
    while kill -0 "$p" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
    kill -9 "$p" 2>/dev/null
  done
  [ -n "${PD_KEEP_TMP:-}" ] || rm -rf "$TMP"
}

# Polls until `cmd` succeeds or `secs` pass. Usage: pd_wait_for SECS CMD...
# The deadline bounds the wait; it never judges speed. PD_TEST_TIME_SCALE (an integer, default 1)
# stretches it for the sanitizer tiers, whose servers run 5-20x slower.
pd_wait_for() {
  secs=$(( $1 * ${PD_TEST_TIME_SCALE:-1} )); shift
  end=$(( $(date +%s) + secs ))
  while ! "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -ge "$end" ] && return 1
    sleep 0.05
  done
  return 0
}

pd_start() {
  name=$1; shift
  "$PD_BIN" serve --model "$MODEL" --host 127.0.0.1 --port 0 "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
  echo $! >"$TMP/$name.pid"
  pd_wait_for 60 grep -q 'http://' "$TMP/$name.out" || { cat "$TMP/$name.err" >&2; pd_fail "$name did not start"; }
  URL=$(grep -o 'http://[0-9.]*:[0-9]*' "$TMP/$name.out" | head -1)
  pd_wait_for 30 curl -sf "$URL/health" || pd_fail "$name: /health never answered"
  eval "URL_$name=\$URL"
}

pd_stop() {
  name=$1
  p=$(cat "$TMP/$name.pid")
  kill -TERM "$p"
  wait "$p"
  rc=$?
  rm -f "$TMP/$name.pid"
  [ $rc = 0 ] || pd_fail "$name exited with status $rc after SIGTERM"
}

# pd_redis_start SECRET [FLAGS...]: redis-server on a free loopback port (requirepass SECRET, no
# persistence, --dir $TMP, log $TMP/redis.log, pid $TMP/redis.pid), waited for (PONG); sets RPORT.
# redis-server cannot pick its own port, so one is picked here and bound by redis-server a moment
# later: when another process took it in between (redis-server exits at once: "Address already in
# use"), another port is tried (3 tries, bounded).
pd_redis_start() {
  secret=$1; shift
  for try in 1 2 3; do
    RPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    redis-server --port "$RPORT" --bind 127.0.0.1 --save '' --appendonly no --requirepass "$secret" \
      --dir "$TMP" "$@" >"$TMP/redis.log" 2>&1 &
    echo $! >"$TMP/redis.pid"
    # ready (PONG), or exited
    pd_wait_for 20 sh -c "REDISCLI_AUTH='$secret' redis-cli -p $RPORT ping 2>/dev/null | grep -q PONG || ! kill -0 $(cat "$TMP/redis.pid")"
    REDISCLI_AUTH="$secret" redis-cli -p "$RPORT" ping 2>/dev/null | grep -q PONG && return 0
    kill -9 "$(cat "$TMP/redis.pid")" 2>/dev/null; wait "$(cat "$TMP/redis.pid")" 2>/dev/null; rm -f "$TMP/redis.pid"
    grep -q "Address already in use" "$TMP/redis.log" || break
  done
  cat "$TMP/redis.log" >&2
  pd_fail "redis-server did not start"
}

# Prometheus sample value of a metric line (exact name + labels) from $1 = metrics text file.
pd_metric() { grep "^$2 " "$1" | head -1 | awk '{print $2}'; }
