#!/bin/sh
# tools/run_tests.sh BUILD_DIR [TEST_BINARY...] — runs tools/check_deps.sh, every test binary given,
# and the integration scripts (tests/integration/*.sh), one at a time, and prints one summary line
# last, which CI reads:
#   "N passed, M failed, K skipped"   (counted per test binary / script)
# Exit status of a test: 0 passed; 77 skipped (the automake convention: it cannot run here, e.g. a
# GPU test without a GPU; it prints a line "skipped: REASON"); anything else failed, a crash or a
# timeout (PD_TEST_TIMEOUT seconds, default 900) included. The runner exits 0 only when nothing
# failed.
# Environment:
#   PD_SKIP_INTEGRATION=1    binaries only
#   PD_INTEGRATION="a.sh b.sh"  only these integration scripts (default: all)
#   PD_NO_SKIP=1             a skipped test counts as failed (make gpu-test: on a GPU machine
#                            nothing may be skipped)
#   PD_DEADLINE=EPOCH_SECS   a time budget (.ci/run sets it so CI ends inside its 90 minutes): a
#                            test is given at most the time left, and once it is spent the tests
#                            not yet run are reported as skipped ("time budget spent"), never as
#                            passed
build="$1"; shift
repo=$(cd "$(dirname "$0")/.." && pwd)
export PD_REPO_DIR="$repo"
export PD_MODELS_DIR="${PD_MODELS_DIR:-$repo/../shared/models}"
export PD_BIN="$repo/$build/pdserve"
# OpenMP threads that spin-wait starve other processes on small machines (2-core CI): sleep instead.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
log=$(mktemp "${TMPDIR:-/tmp}/pd_run_tests.XXXXXX")
trap 'rm -f "$log" "$log.rc"' EXIT
trap 'exit 130' INT TERM
pass=0; fail=0; skip=0; failed=""; skipped=""
t_all=$(date +%s)

run_one() {
  name="$1"; shift
  echo "== $name"
  t0=$(date +%s)
  limit="${PD_TEST_TIMEOUT:-900}"
  if [ -n "${PD_DEADLINE:-}" ]; then
    left=$(( PD_DEADLINE - t0 ))
    if [ "$left" -lt 30 ]; then
      echo "-- $name: skipped (time budget spent: PD_DEADLINE reached) [0s]"
      skip=$((skip+1)); skipped="$skipped $name"
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  { timeout "$limit" "$@"; echo $? >"$log.rc"; } 2>&1 | tee "$log"
  rc=$(cat "$log.rc")
  dt=$(( $(date +%s) - t0 ))
  if [ "$rc" = 77 ] && [ -z "${PD_NO_SKIP:-}" ]; then
    reason=$(grep -m1 -i 'skipped:' "$log" | sed 's/.*[Ss]kipped: *//')
    echo "-- $name: skipped (${reason:-no reason given}) [${dt}s]"
    skip=$((skip+1)); skipped="$skipped $name"
  elif [ "$rc" = 0 ]; then
    echo "-- $name: passed [${dt}s]"
    pass=$((pass+1))
  else
    case "$rc" in
      77) why="skipped, and PD_NO_SKIP is set" ;;
      124) why="timed out after ${limit}s" ;;
      66) why="ThreadSanitizer report" ;;
      *) why="exit status $rc" ;;
    esac
    echo "-- $name: FAILED ($why) [${dt}s]"
    fail=$((fail+1)); failed="$failed $name"
  fi
}

run_one check_deps sh "$repo/tools/check_deps.sh"
for t in "$@"; do run_one "$t" "$t"; done
if [ -z "${PD_SKIP_INTEGRATION:-}" ]; then
  if [ -n "${PD_INTEGRATION:-}" ]; then
    scripts=""; for s in $PD_INTEGRATION; do scripts="$scripts $repo/tests/integration/$s"; done
  else
    scripts=$(ls "$repo"/tests/integration/*.sh 2>/dev/null)
  fi
  for s in $scripts; do
    [ -e "$s" ] || { echo "no such integration script: $s"; fail=$((fail+1)); failed="$failed $(basename "$s")"; continue; }
    run_one "$(basename "$s")" sh "$s"
  done
fi
echo
echo "total time: $(( $(date +%s) - t_all ))s"
[ -n "$skipped" ] && echo "skipped:$skipped"
[ -n "$failed" ] && echo "failed:$failed"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
