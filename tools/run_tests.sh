#!/bin/sh
# Runs every test binary (and tests/integration/*.sh) and prints one summary line that CI reads:
#   "N passed, M failed"  (counted per test binary / script)
# Each binary prints its own per-test lines. A binary that crashes or times out counts as failed.
build="$1"; shift
repo=$(cd "$(dirname "$0")/.." && pwd)
export PD_REPO_DIR="$repo"
export PD_MODELS_DIR="${PD_MODELS_DIR:-$repo/../shared/models}"
export PD_BIN="$repo/$build/pdserve"
# OpenMP threads that spin-wait starve other processes on small machines (2-core CI): sleep instead.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
pass=0; fail=0; failed=""
run_one() {
  name="$1"; shift
  echo "== $name"
  if timeout "${PD_TEST_TIMEOUT:-900}" "$@"; then pass=$((pass+1)); else fail=$((fail+1)); failed="$failed $name"; fi
}
run_one check_deps sh "$repo/tools/check_deps.sh"
for t in "$@"; do run_one "$t" "$t"; done
if [ -z "${PD_SKIP_INTEGRATION:-}" ]; then
  for s in "$repo"/tests/integration/*.sh; do
    [ -e "$s" ] || continue
    run_one "$(basename "$s")" sh "$s"
  done
fi
echo
[ -n "$failed" ] && echo "failed:$failed"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
